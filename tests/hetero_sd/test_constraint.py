"""Constraints from the API, the CLI and YAML: each bad grammar gets one clear
error naming the problem before any generation (CLI exit 2, an exception from
the API, the file and key from YAML), and good ones hold the output."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from hetero_sd.backends.torch_backend import TorchBackend
from hetero_sd.cli import main
from hetero_sd.config import load_config
from hetero_sd.constraint import Constraint
from hetero_sd.constraint.guide import GuideCompiler
from hetero_sd.drafting import NgramDrafter
from hetero_sd.engine import Engine
from hetero_sd.errors import ConfigError, ConstraintError
from hetero_sd.ir import load_model_ir
from hetero_sd.ir.work import DraftResult
from helpers.table_model import TableRunner, TableTokenizer

# (constraint, a phrase the error must contain)
BAD = [
    (Constraint.json_schema({"type": "strin"}), "invalid JSON Schema at type"),
    (Constraint.json_schema('{"type": "object",'), "not valid JSON"),
    (Constraint.json_schema({"type": "integer", "minimum": 5, "maximum": 3}), "Unsatisfiable schema"),
    (Constraint.json_schema({"allOf": [{"type": "string"}, {"type": "number"}]}), "Unsatisfiable schema"),
    (Constraint.regex("[0-9]{3}-[a-z"), "unclosed character class"),
    (Constraint.grammar('root ::= "a" [0-9+'), "invalid grammar"),
    (Constraint.grammar('start: "x" | y'), "unknown name"),
]
CLI_FLAGS = {"json_schema": "--json-schema", "regex": "--regex", "grammar": "--grammar"}


def _table_engine(**kw) -> Engine:
    tok = TableTokenizer()
    return Engine(TableRunner(4, seed=0), None, tokenizer=tok, eos_ids=(tok.eos_token_id,), **kw)


@pytest.mark.parametrize("constraint, phrase", BAD, ids=[f"{c.kind}-{i}" for i, (c, _) in enumerate(BAD)])
def test_bad_constraint_fails_before_generation(constraint, phrase):
    with pytest.raises(ConstraintError, match=re.escape(phrase)):
        constraint.check()
    engine = _table_engine()
    with pytest.raises(ConstraintError, match=re.escape(phrase)):
        engine.generate_ids([0, 1, 2], 8, constraint=constraint)
    assert engine.target.calls == 0  # nothing ran


@pytest.mark.parametrize("constraint, phrase", BAD, ids=[f"{c.kind}-{i}" for i, (c, _) in enumerate(BAD)])
def test_bad_constraint_from_the_cli(constraint, phrase, capsys):
    # checked before the config or any model loads: no --config is needed to see the error
    code = main(["generate", "--prompt", "x", CLI_FLAGS[constraint.kind], constraint.source])
    err = capsys.readouterr().err
    assert code == 2 and phrase in err and CLI_FLAGS[constraint.kind] in err, err
    assert err.count("hetero-sd: error:") == 1 and "Traceback" not in err


def test_cli_takes_one_constraint(capsys):
    assert main(["generate", "--prompt", "x", "--regex", "a", "--any-json"]) == 2
    assert "--regex and --any-json" in capsys.readouterr().err


@pytest.mark.parametrize("body, phrase", [
    ("regex: '[a-'", "generation.constraint.regex: invalid regex"),
    ("json_schema: {type: strin}", "generation.constraint.json_schema: invalid JSON Schema"),
    ("grammar: 'root ::= [0-9+'", "generation.constraint.grammar: invalid grammar"),
    ("json: yes_please", "generation.constraint.json: must be true"),
    ("regexp: 'a'", "unknown constraint kind 'regexp'; allowed: json_schema, json, regex, grammar"),
    ("{regex: 'a', json: true}", "give exactly one of"),
])
def test_bad_constraint_from_yaml(tmp_path, body, phrase):
    path = tmp_path / "c.yaml"
    path.write_text(f"generation:\n  constraint: {body}\n" if body.startswith("{") else
                    f"generation:\n  constraint:\n    {body}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value) and phrase in str(info.value), str(info.value)


def test_yaml_schema_file_relative_to_the_config(tmp_path):
    (tmp_path / "schemas").mkdir()
    (tmp_path / "schemas" / "p.json").write_text(json.dumps({"type": "object", "required": ["a"]}))
    path = tmp_path / "c.yaml"
    path.write_text("generation:\n  constraint:\n    json_schema: schemas/p.json\n")
    spec = load_config(path).generation.constraint_spec(str(path))
    assert spec.kind == "json_schema" and json.loads(spec.source)["required"] == ["a"]


def test_cli_generates_valid_json_from_a_config(tiny_model_dir, tmp_path, capsys):
    schema = {"type": "object", "properties": {"k": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["k"], "additionalProperties": False}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(f"target:\n  model: {tiny_model_dir('llama')}\ndrafter:\n  kind: ngram\n  k: 4\n"
                   "generation:\n  max_new_tokens: 40\n  constraint:\n    json_schema: s.json\n")
    outputs = []
    for extra in ([], ["--target-only"], ["--regex", "[a-c]{4}"]):
        assert main(["generate", "--config", str(cfg), "--prompt", "hello", "--json", *extra]) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    spec, base, flag = outputs
    assert spec["token_ids"] == base["token_ids"] and spec["stats"]["finish_reason"] == "grammar"
    jsonschema.validate(json.loads(spec["text"]), schema)
    assert spec["stats"]["constraint"].startswith("json_schema")
    assert re.fullmatch("[a-c]{4}", flag["text"]) and flag["stats"]["constraint"].startswith("regex")


def test_engine_default_constraint_and_override():
    engine = _table_engine(constraint={"regex": "(ab)+"})
    assert TableTokenizer().decode(engine.generate_ids([0, 1, 2], 6).token_ids) == "ababab"
    assert re.fullmatch("c+", TableTokenizer().decode(
        engine.generate_ids([0, 1, 2], 5, constraint=Constraint.regex("c+")).token_ids))
    with pytest.raises(ConstraintError, match="regex"):
        _table_engine(constraint={"regex": "(ab"})  # the default is compiled at construction


def test_guide_interface():
    """The small interface another library would implement: masks, prefixes, rollback."""
    tok = TableTokenizer()
    guide = GuideCompiler(tok, 4, (tok.eos_token_id,)).guide(Constraint.regex("(a|bc)+"))
    a, b, c, eos = 0, 1, 2, 3
    assert guide.allowed().tolist() == [True, True, False, False]
    assert guide.valid_prefix([b, c, a, b, b]) == 4
    rows = guide.allowed_rows(3, [b, c])
    assert rows.tolist() == [[True, True, False, False], [False, False, True, False], [True, True, False, True]]
    assert guide.allowed().tolist() == [True, True, False, False]  # the walk was undone
    assert guide.accept(a) and guide.accept(b) and not guide.finished
    guide.rollback(1)
    assert guide.allowed().tolist() == [True, True, False, True]  # after "a": EOS allowed
    fixed = GuideCompiler(tok, 4, (eos,)).guide(Constraint.regex("ab"))
    assert fixed.accept(a) and fixed.accept(b) and fixed.finished


class _Silent(NgramDrafter):
    """Never proposes anything: every draft then comes from the grammar."""

    name = "silent"

    def draft(self, req, rnd=None):
        return DraftResult(req.seq_id, [])


def test_forced_tokens_become_drafts(tiny_model_dir):
    """A schema forces its keys: with a drafter that proposes nothing, those are
    drafted anyway, mostly accepted, and the output is unchanged."""
    ir = load_model_ir(tiny_model_dir("llama"))
    tok, target = ir.load_tokenizer(), TorchBackend().load(ir, "cpu", "fp32", 4 << 20)
    schema = {"type": "object", "additionalProperties": False, "required": ["temperature", "description"],
              "properties": {"temperature": {"type": "integer", "minimum": 0, "maximum": 9},
                             "description": {"enum": ["sunny", "overcast with rain"]}}}
    engine = Engine(target, _Silent(), k=6, tokenizer=tok, eos_ids=(tok.eos_token_id,))
    constraint = Constraint.json_schema(schema)
    base = engine.generate_ids([5, 6, 7, 8], 60, target_only=True, constraint=constraint)
    spec = engine.generate_ids([5, 6, 7, 8], 60, constraint=constraint)
    assert spec.token_ids == base.token_ids and spec.stats.finish_reason == "grammar"
    assert spec.stats.grammar_drafted == spec.stats.drafted > 0
    assert spec.stats.accepted > spec.stats.drafted // 2
    assert spec.stats.rounds < base.stats.rounds
    tok4 = TableTokenizer()
    guide = GuideCompiler(tok4, 4, (tok4.eos_token_id,)).guide(Constraint.regex("(a|bc)+"))
    assert guide.forced() == [] and guide.accept(1) and guide.forced() == [2]


def test_tokenizer_wider_than_the_model(tiny_gguf):
    """A GGUF's tokenizer can hold an added token past the model's output layer
    (here <|endoftext|> at id 384 of a 384-row head): the grammar sees every id,
    the masks are cut to the logits the model has."""
    ir = load_model_ir(tiny_gguf("llama", "Q8_0"))
    tok, target = ir.load_tokenizer(), TorchBackend().load(ir, "cpu", "fp32", 4 << 20)
    assert len(tok) > target.vocab_size  # the case under test
    schema = {"type": "object", "properties": {"k": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["k"], "additionalProperties": False}
    engine = Engine(target, NgramDrafter(1, 3), k=4, tokenizer=tok, eos_ids=tuple(ir.config.eos_token_ids))
    base = engine.generate_ids([5, 6, 7], 30, target_only=True, constraint=Constraint.json_schema(schema))
    spec = engine.generate_ids([5, 6, 7], 30, constraint=Constraint.json_schema(schema))
    assert spec.token_ids == base.token_ids and base.stats.finish_reason == "grammar"
    jsonschema.validate(json.loads(base.text), schema)


def test_a_refused_token_leaves_the_guide_intact():
    """The guide is shared with the drafter: a refused accept must not poison it
    (llguidance's matcher never leaves the error state a refused token causes)."""
    tok = TableTokenizer()
    guide = GuideCompiler(tok, 4, (tok.eos_token_id,)).guide(Constraint.regex("(bc)+a"))
    before = guide.allowed().tolist()
    assert not guide.accept(tok.eos_token_id) and not guide.accept(2)
    assert guide.allowed().tolist() == before and guide.accept(1) and guide.accept(2)


class _Clumsy(NgramDrafter):
    """Tries a token the grammar refuses on the shared guide, then fails."""

    name = "clumsy"

    def begin(self, capacity, sampler=None, guide=None):
        super().begin(capacity, sampler, guide)
        self.guide = guide

    def draft(self, req, rnd=None):
        assert not self.guide.accept(3)  # EOS where the grammar does not accept
        raise RuntimeError("a drafter bug")


def test_a_failing_drafter_costs_no_output():
    tok, constraint = TableTokenizer(), Constraint.regex("(bc)+a")
    engine = Engine(TableRunner(4, seed=0), _Clumsy(), k=3, tokenizer=tok, eos_ids=(3,))
    spec = engine.generate_ids([0, 1, 2], 12, constraint=constraint)
    base = engine.generate_ids([0, 1, 2], 12, constraint=constraint, target_only=True)
    assert spec.token_ids == base.token_ids and re.fullmatch("(bc)+a", tok.decode(spec.token_ids))
    assert any("a drafter bug" in e for e in spec.stats.events)


class _Legacy(NgramDrafter):
    name = "legacy"
    takes_guide = False  # declared: written to the contract before guides

    def begin(self, capacity, sampler=None):  # the contract before guides existed
        super().begin(capacity, sampler)


def test_a_drafter_without_a_guide_parameter_keeps_working():
    tok = TableTokenizer()
    engine = Engine(TableRunner(4, seed=0), _Legacy(1, 2), k=3, tokenizer=tok, eos_ids=(3,))
    res = engine.generate_ids([0, 1, 0, 1, 0], 12, constraint=Constraint.regex("(ab|a)+"))
    assert res.stats.events == [] and res.stats.drafted > 0 and engine.drafter.name == "legacy"


def test_a_stop_string_the_grammars_last_token_completes():
    tok = TableTokenizer()
    engine = Engine(TableRunner(4, seed=0), NgramDrafter(1, 2), k=3, tokenizer=tok, eos_ids=(3,), stop=("bc",))
    for target_only in (True, False):
        res = engine.generate_ids([0, 1, 2], 8, target_only=target_only, constraint=Constraint.regex("abc"))
        assert (res.text, res.stats.finish_reason) == ("a", "stop")  # cut at the stop string, as without a grammar
        for budget, reason in ((2, "length"), (3, "grammar")):  # the language's end wins over the budget
            res = engine.generate_ids([0, 1, 2], budget, target_only=target_only, constraint=Constraint.regex("abc"),
                                      stop=[])
            assert (res.text, res.stats.finish_reason) == ("abc"[:budget], reason)


def test_forced_drafts_stop_at_the_models_head():
    """A wider tokenizer's ids (added tokens past the model's head) are never drafted."""
    from hetero_sd.constraint.rounds import Constrainer
    from hetero_sd.stats import GenerationStats

    class Forcing:  # forces an id the model has, then one it has not
        constraint = Constraint.regex("x")

        def valid_prefix(self, tokens):
            return len(tokens)

        def accept(self, token):
            return True

        def rollback(self, n):
            pass

        def forced(self, after=()):
            return [2, 4, 1]

    con = Constrainer(Forcing(), {3}, GenerationStats("ngram"), model_vocab=4)
    assert con.cut([], None, 5) == ([2], None)
    assert con.cut([0], None, 5) == ([0, 2], None)
