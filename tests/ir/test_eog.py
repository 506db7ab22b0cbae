"""End of generation (ir/eog.py): the set of ids generation stops at, built as llama.cpp
builds its EOG set (GGUF eos/eot/eom/FIM ids, end-of-turn texts in the vocabulary, its
exclusions), plus generation_config.json's ids and the chat template's end of turn.

Three models whose end of turn is not their EOS: a GGUF whose eot and eom differ from its
eos, an HF folder whose generation_config.json lists several ids, and a chat template whose
end of turn is a third special token. Generation stops at each of their ids, and
speculation (n-gram drafts, k=4, drafted across the end token) stops at the same token as
target-only decoding."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from hetero_sd.drafting import NgramDrafter
from hetero_sd.engine import Engine
from hetero_sd.ir import eog, load_model_ir
from hetero_sd.ir.config import ModelConfig
from helpers.table_model import TableRunner
from helpers.tiny_models import EOS_ID, IM_END_ID, IM_START_ID, VOCAB_SIZE

TURN_END = "<|END_OF_TURN_TOKEN|>"  # Command-R's end of turn: in no llama.cpp list
PLAIN = 57  # an ordinary token that a file declares an end id
EOM = 200  # an ordinary token a GGUF names as its eom


def _config(eos_ids=(), vocab=VOCAB_SIZE) -> ModelConfig:
    return ModelConfig(family="llama", vocab_size=vocab, hidden_size=8, intermediate_size=8, num_layers=1,
                       num_heads=1, num_kv_heads=1, head_dim=8, rms_norm_eps=1e-5, rope_theta=1e4,
                       max_position_embeddings=64, tie_word_embeddings=True, eos_token_ids=tuple(eos_ids))


# ---------------------------------------------------------------- the rules, as pure functions
def test_gguf_metadata_ids_are_llama_cpps_six_keys():
    fields = {"tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.eot_token_id": 106,
              "tokenizer.ggml.eom_token_id": 999, "tokenizer.ggml.fim_sep_token_id": 7,
              "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.padding_token_id": 0}
    # bos/pad are not end ids; an id outside the vocabulary is ignored (llama.cpp warns and ignores it)
    assert eog.gguf_end_ids(fields, 300) == {"tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.eot_token_id": 106,
                                            "tokenizer.ggml.fim_sep_token_id": 7}
    assert eog.id_list(None) == () and eog.id_list(5) == (5,) and eog.id_list([1, 106]) == (1, 106)


def test_vocabulary_texts_follow_llama_cpps_lists():
    vocab = {"<|im_end|>": 2, "<|endoftext|>": 0, "<|im_start|>": 1, "<reponame>": 4, "<|repo_name|>": 9,
             "<|fim_pad|>": 11, "<|fim_prefix|>": 12, "<end_of_turn>": 106, "hello": 50}
    found = eog.vocab_end_ids(vocab)
    # end-of-turn texts, one FIM repo token (the lowest id of its texts) and the FIM pad; not FIM prefix
    assert sorted(found) == [0, 2, 4, 11, 106]
    assert found[4] == "llama.cpp fim_rep text"


def test_llama_cpp_exclusions():
    harmony = {200002: "<|return|>", 200012: "<|call|>", 200007: "<|end|>", 199999: "<|endoftext|>"}
    assert eog.llama_cpp_exclusions(harmony) == {200007}
    assert eog.llama_cpp_exclusions({5: "<|calls|>", 6: "<|flush|>", 7: "<|end|>"}) == {7}
    assert eog.llama_cpp_exclusions({1: "<|end|>", 2: "<|endoftext|>"}) == set()  # Phi-3 keeps <|end|>
    assert eog.llama_cpp_exclusions({1: "</s>", 2: "<|tool_response>"}) == {1}


@pytest.mark.parametrize("template,special,want", [
    # ChatML
    ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}",
     {"<|im_start|>": 1, "<|im_end|>": 2}, 2),
    # Llama 3: content, then <|eot_id|>
    (("{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content | trim }}"
      "<|eot_id|>{% endfor %}"), {"<|start_header_id|>": 5, "<|end_header_id|>": 6, "<|eot_id|>": 7}, 7),
    # Llama 2: ' ' + eos after an assistant reply
    (("{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content }} [/INST]{% else %} {{ m.content }} "
      "</s>{% endif %}{% endfor %}"), {"</s>": 2, "<s>": 1}, 2),
    # no special token after the content
    ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n\n{% endfor %}", {"<s>": 1}, None),
    # a template that takes no assistant turn
    ("{% for m in messages %}{% if m.role == 'assistant' %}{{ raise_exception('no') }}{% endif %}{% endfor %}",
     {"<s>": 1}, None),
])
def test_template_end_of_turn(template, special, want):
    import jinja2

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    compiled = jinja2.Environment().from_string(template)
    render = lambda messages: compiled.render(messages=messages, raise_exception=raise_exception)
    assert eog.template_end_token(render, special) == want


def test_config_alone():
    assert eog.eog_ids(_config((1, 7, 900))) == (1, 7)  # 900 is outside the vocabulary
    assert eog.describe_eog(_config((1,))) == [(1, "", "model config")]


# ---------------------------------------------------------------- the three models
def _steered(chain: list[int]) -> TableRunner:
    """A target whose greedy next token is a fixed successor of the last token: chain[i] ->
    chain[i + 1], anything else -> 100 + (t % 50) (never an end id here)."""
    succ = dict(zip(chain, chain[1:]))

    class Steered(TableRunner):
        def logits_for(self, context):
            row = np.zeros(self.vocab_size, np.float32)
            row[succ.get(context[-1], 100 + context[-1] % 50)] = 10.0
            return row

    return Steered(vocab=VOCAB_SIZE, seed=0)


def _assert_stops_at(end: int, eos_ids) -> None:
    """Target-only and speculative greedy decoding both stop at `end`: the prompt holds the chain
    through `end` and beyond, so the n-gram drafter (k=4) proposes `end` and what followed it."""
    chain = [300 + i for i in range(10)] + [end, 360, 361, 362]
    prompt = [20] + chain + [21, chain[0]]
    target = _steered(chain)
    engine = Engine(target, NgramDrafter(1, 3), k=4, eos_ids=tuple(eos_ids))
    base = engine.generate_ids(prompt, 40, target_only=True)
    spec = engine.generate_ids(prompt, 40)
    assert base.token_ids == chain[1:10], f"target-only did not stop at {end}"
    assert spec.token_ids == base.token_ids, f"speculation ran past {end}"
    assert spec.stats.finish_reason == base.stats.finish_reason == "eos"
    assert spec.stats.accepted > 0  # the drafts were taken, the end token among them
    without = Engine(_steered(chain), NgramDrafter(1, 3), k=4, eos_ids=tuple(i for i in eos_ids if i != end))
    assert len(without.generate_ids(prompt, 40).token_ids) > 9  # the id is what stops it


@pytest.fixture(scope="module")
def gguf_eot(tiny_model_dir, tmp_path_factory):
    """The tiny Llama as a GGUF whose eos is </s>, eot <|im_end|> and eom an ordinary token."""
    import gguf

    from helpers.tiny_models import make_gguf

    header = gguf.GGUFWriter.write_header_to_file

    def with_end_ids(self, *args, **kwargs):
        self.add_eot_token_id(IM_END_ID)
        self.add_eom_token_id(EOM)
        return header(self, *args, **kwargs)

    gguf.GGUFWriter.write_header_to_file = with_end_ids
    try:
        return make_gguf(tiny_model_dir("llama"), tmp_path_factory.mktemp("eog_gguf") / "eot.gguf")
    finally:
        gguf.GGUFWriter.write_header_to_file = header


def test_gguf_whose_eos_is_not_its_eot(gguf_eot):
    ir = load_model_ir(gguf_eot)
    assert ir.config.eos_token_ids == (EOS_ID, IM_END_ID, EOM)  # the loader reads eos, eot and eom
    rows = {i: (text, source) for i, text, source in eog.describe_eog(ir, ir.load_tokenizer())}
    assert set(rows) == {EOS_ID, IM_END_ID, EOM}
    assert eog.gguf_end_keys(gguf_eot) == {"tokenizer.ggml.eos_token_id": EOS_ID,
                                           "tokenizer.ggml.eot_token_id": IM_END_ID,
                                           "tokenizer.ggml.eom_token_id": EOM}
    assert rows[IM_END_ID] == ("<|im_end|>", ("tokenizer.ggml.eot_token_id, llama.cpp end-of-generation text, "
                                              "chat template end of turn"))
    assert rows[EOS_ID][0] == "</s>" and rows[EOS_ID][1].startswith("tokenizer.ggml.eos_token_id, tokenizer eos_token")
    assert rows[EOM][1] == "tokenizer.ggml.eom_token_id"
    for end in (IM_END_ID, EOM):
        _assert_stops_at(end, eog.eog_ids(ir, ir.load_tokenizer()))


@pytest.fixture(scope="module")
def hf_several_eos(tiny_model_dir, tmp_path_factory):
    """The tiny Llama whose generation_config.json lists </s>, <|im_end|> and an ordinary token."""
    folder = tmp_path_factory.mktemp("eog_hf") / "llama"
    shutil.copytree(tiny_model_dir("llama"), folder)
    gen = json.loads((folder / "generation_config.json").read_text())
    gen["eos_token_id"] = [EOS_ID, IM_END_ID, PLAIN]
    (folder / "generation_config.json").write_text(json.dumps(gen))
    return folder


def test_hf_generation_config_lists_several_ids(hf_several_eos):
    ir = load_model_ir(hf_several_eos)
    tok = ir.load_tokenizer()
    assert ir.config.eos_token_ids == (EOS_ID,)  # config.json's
    rows = {i: source for i, _, source in eog.describe_eog(ir, tok)}
    assert set(rows) == {EOS_ID, IM_END_ID, PLAIN}
    assert rows[PLAIN] == "generation_config.json eos_token_id"
    assert "config.json eos_token_id" in rows[EOS_ID]
    for end in (EOS_ID, IM_END_ID, PLAIN):
        _assert_stops_at(end, eog.eog_ids(ir, tok))


@pytest.fixture(scope="module")
def template_third_token(tiny_model_dir, tmp_path_factory):
    """The tiny Llama whose special token 2 is Command-R's <|END_OF_TURN_TOKEN|>, which its chat
    template writes after each message: neither its eos (</s>) nor a llama.cpp text."""
    folder = tmp_path_factory.mktemp("eog_template") / "llama"
    shutil.copytree(tiny_model_dir("llama"), folder)
    tok = json.loads((folder / "tokenizer.json").read_text())
    for added in tok["added_tokens"]:
        if added["id"] == IM_START_ID:
            added["content"] = TURN_END
    vocab = tok["model"]["vocab"]
    vocab[TURN_END] = vocab.pop("<|im_start|>")
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["extra_special_tokens"] = [TURN_END, "<|im_end|>"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").write_text(
        "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '" + TURN_END
        + "' }}{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    return folder


def test_chat_template_end_of_turn_is_a_third_token(template_third_token):
    ir = load_model_ir(template_third_token)
    tok = ir.load_tokenizer()
    assert tok.convert_ids_to_tokens(IM_START_ID) == TURN_END
    rows = {i: (text, source) for i, text, source in eog.describe_eog(ir, tok)}
    assert rows[IM_START_ID] == (TURN_END, "chat template end of turn")
    assert set(rows) == {EOS_ID, IM_START_ID, IM_END_ID}  # <|im_end|>: a llama.cpp text
    for end in (EOS_ID, IM_START_ID):
        _assert_stops_at(end, eog.eog_ids(ir, tok))


def test_an_engine_built_from_a_config_stops_at_the_whole_set(template_third_token, tmp_path):
    """hetero_sd/build.py gives the Engine the whole set."""
    from hetero_sd.config import load_config

    path = tmp_path / "cfg.yaml"
    path.write_text(f"target: {{model: {template_third_token}, backend: torch, precision: fp32}}\n"
                    "drafter: {kind: ngram, k: 4}\nmemory: {kv_budget: 1MiB}\n")
    engine = Engine.from_config(load_config(path))
    assert engine.eos_ids == {EOS_ID, IM_START_ID, IM_END_ID}



def test_ignore_eos_runs_past_the_set_alike_with_and_without_drafts(tiny_model_dir):
    """generation.ignore_eos (generate --ignore-eos): the budget, not the set, ends the run."""
    from hetero_sd.backends.registry import discover
    from hetero_sd.drafting import NgramDrafter
    from hetero_sd.ir import load_model_ir

    target = discover().get("torch").load(load_model_ir(tiny_model_dir("llama")), "cpu", "fp32", 8 << 20)
    prompt = [1, 7, 9, 7, 9, 7, 9]
    first = Engine(target).generate_ids(prompt, 12, target_only=True).token_ids
    stop_at = first[3]
    runs = [Engine(target, NgramDrafter(1, 3), k=4, eos_ids=(stop_at,), ignore_eos=ignore).generate_ids(
        prompt, 12, target_only=only) for ignore in (False, True) for only in (True, False)]
    stopped, stopped_spec, full, full_spec = (r.token_ids for r in runs)
    assert stopped == stopped_spec == first[:first.index(stop_at)]  # (the end token is not output)
    assert full == full_spec == first and runs[2].stats.finish_reason == "length"


def test_models_details_shows_the_set(tiny_gguf, capsys):
    from hetero_sd.cli import main

    assert main(["models", "--details", str(tiny_gguf("llama")), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["end_of_generation"]
    assert rows and all({"id", "text", "sources"} <= row.keys() for row in rows)
