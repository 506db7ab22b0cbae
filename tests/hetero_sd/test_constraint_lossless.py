"""Greedy decoding under a grammar: speculative output is token-identical to
constrained target-only output, and every finished output is valid.

Validity is checked by independent means: `json` + `jsonschema` for schemas,
Python's `re` for regexes, and a regex equivalent to the (regular) GBNF
grammar. The termination edge: a language that ends mid-window (a fixed-length
regex, a one-enum schema) stops both modes at the same token with
finish_reason "grammar", and an EOS that is the last draft of a window ends
both at the same token with "eos".
"""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from hetero_sd.backends.registry import load_builtin
from hetero_sd.backends.torch_backend import TorchBackend
from hetero_sd.constraint import Constraint
from hetero_sd.drafting import ModelDrafter, NgramDrafter
from hetero_sd.drafting.base import Drafter, apply_delta
from hetero_sd.engine import Engine
from hetero_sd.ir import load_model_ir
from hetero_sd.ir.work import DraftResult
from helpers.table_model import TableRunner, TableTokenizer
from helpers.tiny_models import random_prompt

BACKEND = TorchBackend()
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "n", "ok", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "n": {"type": "integer", "minimum": 0, "maximum": 999},
                         "ok": {"type": "boolean"},
                         "tags": {"type": "array", "items": {"enum": ["a", "bc", "def"]}, "maxItems": 3}}}
REGEX = r"[a-z]{2,5}(-[0-9]{1,3}){1,3}\."
GBNF = 'root ::= item ("," item)* "."\nitem ::= [a-e]{1,4} | "(" [0-9] ")"'
GBNF_AS_REGEX = r"([a-e]{1,4}|\([0-9]\))(,([a-e]{1,4}|\([0-9]\)))*\."
CONSTRAINTS = {"json_schema": Constraint.json_schema(SCHEMA), "regex": Constraint.regex(REGEX),
               "gbnf": Constraint.grammar(GBNF)}


def assert_valid(kind: str, text: str) -> None:
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    else:
        assert re.fullmatch(REGEX if kind == "regex" else GBNF_AS_REGEX, text), f"{kind}: {text!r}"


def assert_identical(engine: Engine, prompt, max_new: int, constraint, label: str):
    base = engine.generate_ids(prompt, max_new, target_only=True, constraint=constraint)
    spec = engine.generate_ids(prompt, max_new, constraint=constraint)
    assert spec.token_ids == base.token_ids, f"{label}: {spec.text!r} != target-only {base.text!r}"
    assert spec.stats.finish_reason == base.stats.finish_reason, label
    return base, spec


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    ir = load_model_ir(tiny_model_dir("llama"))
    tok = ir.load_tokenizer()
    return (BACKEND.load(ir, "cpu", "fp32", 4 << 20), tok,
            BACKEND.load(load_model_ir(tiny_model_dir("llama", seed=1)), "cpu", "fp32", 4 << 20))


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_tiny_constrained_lossless(tiny, kind, drafter):
    target, tok, other = tiny
    totals = {"drafted": 0, "accepted": 0, "finished": 0}
    for k in range(1, 9):
        d = NgramDrafter(1, 3) if drafter == "ngram" else ModelDrafter(other, target.vocab_size)
        engine = Engine(target, d, k=k, tokenizer=tok, eos_ids=(tok.eos_token_id,))
        for seed in range(2):
            prompt = random_prompt(6 + 5 * seed + k, seed=40 + 3 * k + seed)
            base, spec = assert_identical(engine, prompt, 64, CONSTRAINTS[kind], f"{kind} {drafter} k={k} s={seed}")
            if base.stats.finish_reason in ("grammar", "eos"):
                assert_valid(kind, base.text)
                totals["finished"] += 1
            totals["drafted"] += spec.stats.drafted
            totals["accepted"] += spec.stats.accepted
    assert totals["finished"] >= 12, totals  # most runs end inside the budget, so validity is tested
    assert totals["drafted"] > totals["accepted"] > 0, totals  # both outcomes happened


def test_unconstrained_output_would_be_invalid(tiny):
    """The constraint does the work: the same prompts without it give invalid text."""
    target, tok, _ = tiny
    engine = Engine(target, None, tokenizer=tok, eos_ids=(tok.eos_token_id,))
    text = engine.generate_ids(random_prompt(10, seed=3), 40).text
    with pytest.raises((json.JSONDecodeError, jsonschema.ValidationError)):
        assert_valid("json_schema", text)
    assert not re.fullmatch(REGEX, text)


@pytest.mark.parametrize("constraint, expect", [
    (Constraint.regex(r"[a-z]{3}-[0-9]{2}"), r"[a-z]{3}-[0-9]{2}"),
    (Constraint.json_schema({"enum": ["alpha", "beta gamma"]}), r'"(alpha|beta gamma)"')])
def test_language_ending_mid_window(tiny, constraint, expect):
    """The grammar's end inside a window of k >= 4 stops where target-only stops."""
    target, tok, other = tiny
    for k in (4, 6, 8):
        for drafter in (NgramDrafter(1, 2), ModelDrafter(other, target.vocab_size),
                        ScriptedDrafter(target, tok, constraint, extra=[5, 6, 7])):
            engine = Engine(target, drafter, k=k, tokenizer=tok, eos_ids=(tok.eos_token_id,))
            base, spec = assert_identical(engine, random_prompt(12, seed=k), 40, constraint, f"k={k}")
            assert base.stats.finish_reason == "grammar" and re.fullmatch(expect, base.text), base.text
            if isinstance(drafter, ScriptedDrafter):  # it drafted past the end: the grammar cut it
                assert spec.stats.grammar_cut > 0 and spec.stats.rounds < len(spec.token_ids)


class ScriptedDrafter(Drafter):
    """Drafts what constrained target-only decoding will emit (computed up front,
    through a second engine), followed by `extra` tokens: whole windows are right,
    and then run past the output's end."""

    name = "scripted"

    def __init__(self, target, tok, constraint, extra: list[int], eos_ids=None):
        self.target, self.tok, self.constraint, self.extra = target, tok, constraint, extra
        self.eos_ids = (tok.eos_token_id,) if eos_ids is None else eos_ids
        self.context, self.script = [], None

    def begin(self, capacity, sampler=None, guide=None):
        self.context = []

    def reset(self):
        self.context, self.script = [], None

    def draft(self, req, rnd=None):
        apply_delta(self.context, req)
        if self.script is None:  # the first request carries the prompt
            self.prompt = list(self.context)
            oracle = Engine(self.target, None, tokenizer=self.tok, eos_ids=self.eos_ids)
            self.script = oracle.generate_ids(self.prompt, 64, constraint=self.constraint).token_ids + self.extra
        done = len(self.context) - len(self.prompt)
        return DraftResult(req.seq_id, self.script[done:done + req.k])


def test_eos_as_the_last_draft():
    """An EOS that ends a window ends both modes at the same token, with "eos"."""
    tok, target = TableTokenizer(), TableRunner(4, seed=0)
    constraint, eos = Constraint.regex("(a|bc)+"), tok.eos_token_id
    ended = 0
    for start in range(12):
        prompt = [start % 3, (start // 3) % 3, 2, 0, 1]
        ref = Engine(target, None, tokenizer=tok, eos_ids=(eos,)).generate_ids(prompt, 40, constraint=constraint)
        if ref.stats.finish_reason != "eos":
            continue
        ended += 1
        for k in range(2, 7):
            # windows aligned so that the EOS is the last draft of one of them
            drafter = ScriptedDrafter(target, tok, constraint, extra=[eos], eos_ids=(eos,))
            engine = Engine(target, drafter, k=k, tokenizer=tok, eos_ids=(eos,))
            base, spec = assert_identical(engine, prompt, 40, constraint, f"start={start} k={k}")
            assert spec.stats.finish_reason == "eos" and spec.token_ids == ref.token_ids
            assert re.fullmatch("(a|bc)+", tok.decode(spec.token_ids))
    assert ended >= 3, "test setup: too few prompts end with EOS"


def test_smollm2_constrained_lossless(smollm2_gguf):
    """The real model on the default (exact) target, onnxruntime int4: a schema, a
    regex and a GBNF grammar; n-gram drafts at k = 1..8, a draft model at k = 2, 5, 8."""
    ir = load_model_ir(smollm2_gguf)
    ort = load_builtin("onnxruntime")
    target, tok = ort.load(ir, "cpu", "int4", 64 << 20), ir.load_tokenizer()
    draft = ort.load(ir, "cpu", "int4", 64 << 20)  # the same weights: drafts mostly accepted
    eos = (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>"))
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
              "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}}}
    cases = [
        (Constraint.json_schema(schema), "Extract as JSON with keys name, age, city: Maria Lopez, 34, lives "
                                         "in Valencia.", lambda t: jsonschema.validate(json.loads(t), schema)),
        (Constraint.regex(r"[0-9]{3}-[0-9]{4}"), "Make up a phone number.",
         lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t) or pytest.fail(t)),
        (Constraint.grammar('root ::= "- " item ("\\n- " item){2}\nitem ::= [A-Za-z ]{1,30}'),
         "List three fruits.", lambda t: re.fullmatch(r"- [A-Za-z ]{1,30}(\n- [A-Za-z ]{1,30}){2}", t)
         or pytest.fail(t)),
    ]
    drafters = [(k, NgramDrafter(1, 3)) for k in range(1, 9)]
    drafters += [(k, ModelDrafter(draft, target.vocab_size)) for k in (2, 5, 8)]
    accepted = 0
    for constraint, text, check in cases:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      tokenize=True)
        prompt = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        for k, drafter in drafters:
            engine = Engine(target, drafter, k=k, tokenizer=tok, eos_ids=eos)
            base, spec = assert_identical(engine, prompt, 40, constraint, f"smollm2 {constraint.kind} k={k}")
            assert base.stats.finish_reason in ("grammar", "eos"), base.text
            check(base.text)
            accepted += spec.stats.accepted
    assert accepted > 0
