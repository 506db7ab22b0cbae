"""Loading: config parsing, lazy weights, tokenizers. Error messages: test_loading_errors.py."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from helpers import tiny_models as tm
from helpers.tiny_models import hf_logits, random_prompt
from hetero_sd.ir import load_model_ir, reference_logits

COMMON = dict(
    family="llama", vocab_size=tm.VOCAB_SIZE, hidden_size=tm.HIDDEN, intermediate_size=tm.INTERMEDIATE,
    num_layers=tm.NUM_LAYERS, num_heads=tm.NUM_HEADS, num_kv_heads=tm.NUM_KV_HEADS, head_dim=tm.HEAD_DIM,
    max_position_embeddings=tm.MAX_POSITIONS, bos_token_id=tm.BOS_ID,
)

EXPECTED = {
    "llama": dict(rope_theta=50000.0, rope_scaling=None, tie_word_embeddings=False,
                  attention_bias=False, sliding_window=None, eos_token_ids=(tm.EOS_ID,)),
    "llama-tied": dict(rope_theta=10000.0, rope_scaling=None, tie_word_embeddings=True,
                       attention_bias=False, sliding_window=None, eos_token_ids=(tm.EOS_ID,)),
    "llama-rope-linear": dict(rope_theta=10000.0, rope_scaling={"rope_type": "linear", "factor": 2.0},
                              tie_word_embeddings=False, attention_bias=False, sliding_window=None,
                              eos_token_ids=(tm.EOS_ID,)),
    "llama3-rope": dict(rope_theta=10000.0,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
                        tie_word_embeddings=False, attention_bias=False, sliding_window=None,
                        eos_token_ids=(tm.EOS_ID,)),
    "mistral-swa": dict(rope_theta=10000.0, rope_scaling=None, tie_word_embeddings=False,
                        attention_bias=False, sliding_window=8, eos_token_ids=(tm.EOS_ID,)),
    # Qwen2 configs carry sliding_window settings that are off unless use_sliding_window.
    "qwen2": dict(rope_theta=1000000.0, rope_scaling=None, tie_word_embeddings=False,
                  attention_bias=True, sliding_window=None, eos_token_ids=(tm.IM_END_ID, tm.EOS_ID)),
}


def _check_config(cfg, expected: dict, what: str):
    for key, want in {**COMMON, **expected}.items():
        got = getattr(cfg, key)
        if key == "rope_scaling" and want is not None:
            assert got is not None, f"{what}: rope_scaling missing"
            # Extra keys (e.g. a carried-over rope_theta) are tolerated; the ones the forward uses must match.
            assert {k: got.get(k) for k in want} == want, f"{what}: rope_scaling {got}"
        elif key == "eos_token_ids":
            assert tuple(got) == want, f"{what}: eos_token_ids {got}"
        else:
            assert got == want, f"{what}: {key} = {got!r}, want {want!r}"
    assert cfg.rms_norm_eps == pytest.approx(tm.RMS_EPS, rel=1e-6)


# ------------------------------------------------------------------------ config
@pytest.mark.parametrize("variant", tm.VARIANTS)
def test_hf_config_fields(tiny_model_dir, variant):
    ir = load_model_ir(tiny_model_dir(variant))
    _check_config(ir.config, EXPECTED[variant], variant)


@pytest.mark.parametrize("variant", ["llama", "llama-tied", "llama-rope-linear", "qwen2"])
def test_gguf_config_fields(tiny_gguf, variant):
    ir = load_model_ir(tiny_gguf(variant, "Q8_0"))
    expected = dict(EXPECTED[variant])
    # A GGUF names a single end-of-sequence token (the tokenizer's eos).
    expected["eos_token_ids"] = (tm.EOS_ID,)
    _check_config(ir.config, expected, f"{variant} GGUF")


def test_accepts_str_and_path(tiny_model_dir):
    folder = tiny_model_dir("llama")
    assert load_model_ir(str(folder)).config == load_model_ir(folder).config


def test_legacy_transformers4_config(tiny_model_dir, tmp_path):
    """Checkpoints written by transformers 4.x keep rope_theta at top level and use rope_scaling."""
    legacy = tmp_path / "legacy"
    shutil.copytree(tiny_model_dir("llama-rope-linear"), legacy)
    cfg = json.loads((legacy / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params["rope_theta"]
    cfg["rope_scaling"] = {"type": "linear", "factor": params["factor"]}  # oldest spelling: "type"
    (legacy / "config.json").write_text(json.dumps(cfg))
    ir = load_model_ir(legacy)
    assert ir.config.rope_theta == 10000.0
    assert ir.config.rope_scaling["rope_type"] == "linear" and ir.config.rope_scaling["factor"] == 2.0
    ids = random_prompt(20, seed=7)
    ours, ref = reference_logits(ir, ids), hf_logits(legacy, ids)
    assert (ours - ref).abs().max().item() <= 1e-4


# ------------------------------------------------------------------------ laziness
def test_hf_weights_are_lazy(tiny_model_dir, monkeypatch):
    """Loading opens the safetensors files but reads no tensor; `get` reads exactly one."""
    import safetensors

    reads: list[str] = []
    real_open = safetensors.safe_open

    class CountingHandle:
        def __init__(self, *args, **kwargs):
            self._h = real_open(*args, **kwargs)

        def get_tensor(self, name):
            reads.append(name)
            return self._h.get_tensor(name)

        def get_slice(self, name):
            reads.append(name)
            return self._h.get_slice(name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self._h.__exit__(*exc)

        def __getattr__(self, attr):
            return getattr(self._h, attr)

    monkeypatch.setattr(safetensors, "safe_open", CountingHandle)
    ir = load_model_ir(tiny_model_dir("llama"))
    assert reads == [], f"load_model_ir read tensors eagerly: {reads[:5]}"
    names = ir.weights.names()
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names
    assert reads == []
    w = ir.weights.get("model.layers.0.self_attn.q_proj.weight")
    assert reads == ["model.layers.0.self_attn.q_proj.weight"]
    assert w.dtype == torch.float32 and tuple(w.shape) == (tm.NUM_HEADS * tm.HEAD_DIM, tm.HIDDEN)


def test_gguf_weights_are_lazy(tiny_gguf, monkeypatch):
    """Loading a GGUF dequantizes nothing; `get` dequantizes exactly the one tensor."""
    import gguf

    calls: list[tuple] = []
    real = gguf.quants.dequantize

    def counting(data, qtype):
        calls.append((tuple(data.shape), qtype))
        return real(data, qtype)

    monkeypatch.setattr(gguf.quants, "dequantize", counting)
    ir = load_model_ir(tiny_gguf("llama", "Q8_0"))
    assert calls == []
    assert "model.layers.1.mlp.down_proj.weight" in ir.weights.names()
    w = ir.weights.get("model.layers.1.mlp.down_proj.weight")
    assert len(calls) == 1 and calls[0][1] == gguf.GGMLQuantizationType.Q8_0
    assert w.dtype == torch.float32 and tuple(w.shape) == (tm.HIDDEN, tm.INTERMEDIATE)


@pytest.mark.parametrize("fmt", [
    "hf",
    "gguf",
])
def test_get_returns_independent_tensors(tiny_model_dir, tiny_gguf, fmt):
    """Backends may cast or edit weights in place; that must not leak into later gets."""
    ir = load_model_ir(tiny_model_dir("llama") if fmt == "hf" else tiny_gguf("llama", "F32"))
    name = "model.layers.0.input_layernorm.weight"
    before = ir.weights.get(name).clone()
    ir.weights.get(name).add_(1.0)
    assert torch.equal(ir.weights.get(name), before)


def test_gguf_names_are_hf_names(tiny_gguf):
    names = set(load_model_ir(tiny_gguf("qwen2", "F32")).weights.names())
    assert "model.layers.0.self_attn.q_proj.bias" in names
    assert "model.layers.1.mlp.gate_proj.weight" in names
    assert not any(n.startswith(("blk.", "token_embd", "output")) for n in names)
    tied = set(load_model_ir(tiny_gguf("llama-tied", "F32")).weights.names())
    assert "lm_head.weight" not in tied and "model.embed_tokens.weight" in tied


# ------------------------------------------------------------------------ tokenizers
SENTENCE = "The quick brown fox asked the robot: why is the sky blue? 12345 boats!"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
CHATML = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"


def _check_tokenizer(tok, what):
    ids = tok(SENTENCE, add_special_tokens=False).input_ids
    assert all(0 <= i < tm.VOCAB_SIZE for i in ids)
    assert len(ids) < len(SENTENCE), f"{what}: no merges applied"
    assert tok.decode(ids) == SENTENCE, f"{what}: round trip gave {tok.decode(ids)!r}"
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text == CHATML, f"{what}: chat template gave {text!r}"
    chat_ids = tok(text, add_special_tokens=False).input_ids
    assert chat_ids.count(tm.IM_START_ID) == 3 and chat_ids.count(tm.IM_END_ID) == 2, \
        f"{what}: ChatML markers not single special tokens: {chat_ids}"
    assert tok.convert_tokens_to_ids(tok.eos_token) == tm.EOS_ID
    assert tok.convert_tokens_to_ids(tok.bos_token) == tm.BOS_ID
    return ids


@pytest.mark.parametrize("variant", ["llama", "qwen2"])
def test_tokenizer_folder_and_gguf_agree(tiny_model_dir, tiny_gguf, variant):
    from_folder = _check_tokenizer(load_model_ir(tiny_model_dir(variant)).load_tokenizer(), f"{variant} folder")
    from_gguf = _check_tokenizer(load_model_ir(tiny_gguf(variant, "F32")).load_tokenizer(), f"{variant} GGUF")
    assert from_folder == from_gguf


def test_a_gguf_tokenizer_is_built_once_and_then_read_from_the_cache(tiny_gguf, monkeypatch):
    """Building a tokenizer from a GGUF parses the whole file; the second load reads
    the saved one, which tokenizes and templates exactly as the first."""
    import transformers

    ir = load_model_ir(tiny_gguf("qwen2", "F32"))
    first = ir.load_tokenizer()
    original = transformers.AutoTokenizer.from_pretrained

    def no_gguf(*args, **kwargs):
        assert "gguf_file" not in kwargs, "the GGUF was parsed again"
        return original(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_gguf)
    again = ir.load_tokenizer()
    assert _check_tokenizer(again, "cached GGUF") == _check_tokenizer(first, "GGUF")
    assert again.get_vocab() == first.get_vocab() and again.chat_template == first.chat_template


@pytest.mark.parametrize("variant, qtype", [("llama", "Q8_0"), ("qwen2", "F32")])
def test_the_fast_gguf_reader_reads_what_gguf_reads(tiny_gguf, variant, qtype):
    """Array fields read as one block: every scalar and numeric array as the gguf
    package reads it, string arrays with the same element count, the same tensors."""
    import gguf

    from hetero_sd.ir.model import _fast_reader

    path = str(tiny_gguf(variant, qtype))
    fast, stock = _fast_reader()(path), gguf.GGUFReader(path)
    assert list(fast.fields) == list(stock.fields)
    string_arrays = 0
    for key, want in stock.fields.items():
        got = fast.fields[key]
        assert (got.offset, got.types[0]) == (want.offset, want.types[0]), key
        if want.types[0] == gguf.GGUFValueType.ARRAY and want.types[-1] == gguf.GGUFValueType.STRING:
            string_arrays += 1
            assert int(got.parts[4][0]) == len(want.data), key
        else:
            assert got.contents() == want.contents(), key
    assert string_arrays >= 2  # the vocabulary and the merges at least
    assert [(t.name, t.tensor_type, t.data_offset, tuple(t.shape), t.data.tobytes()) for t in fast.tensors] == \
        [(t.name, t.tensor_type, t.data_offset, tuple(t.shape), t.data.tobytes()) for t in stock.tensors]
