"""The IR's reference forward must reproduce transformers' logits.

transformers (float32, eager attention) is the oracle. Every tiny variant is compared on a
prompt longer than Mistral's sliding window; GGUF files are compared against the HF model they
were converted from (F32: same numbers, which proves the Q/K un-permute) or against an HF copy
whose weights went through the same storage type and back (F16 / Q8_0: then the only
difference left is float32 rounding, so the tolerance stays 1e-4).
"""
from __future__ import annotations


import pytest
import torch

from helpers.tiny_models import FAMILY_VARIANTS, VARIANTS, hf_logits, random_prompt
from hetero_sd.ir import load_model_ir, reference_logits
from helpers.logits import ATOL, assert_logits_match



# ------------------------------------------------------------------------ HF folders
@pytest.mark.parametrize("variant", VARIANTS)
def test_hf_folder_matches_transformers(tiny_model_dir, variant):
    folder = tiny_model_dir(variant)
    ids = random_prompt(40, seed=1)
    ours = reference_logits(load_model_ir(folder), ids)
    assert_logits_match(ours, hf_logits(folder, ids), what=variant)


@pytest.mark.parametrize("variant", ["llama-rope-linear", "llama3-rope", "mistral-swa"])
def test_long_prompt_matches_transformers(tiny_model_dir, variant):
    """Past llama3's original context (32) many times over, and 25x Mistral's window."""
    folder = tiny_model_dir(variant)
    ids = random_prompt(200, seed=2)
    ours = reference_logits(load_model_ir(folder), ids)
    assert_logits_match(ours, hf_logits(folder, ids), what=f"{variant} T=200")


def test_sliding_window_changes_the_answer(tiny_model_dir):
    """Guards the SWA parity test: with the window dropped the logits must differ past it."""
    from dataclasses import replace

    folder = tiny_model_dir("mistral-swa")
    ir = load_model_ir(folder)
    assert ir.config.sliding_window == 8
    ids = random_prompt(40, seed=1)
    windowed = reference_logits(ir, ids)
    ir.config = replace(ir.config, sliding_window=None)
    full = reference_logits(ir, ids)
    # Position p attends to the last 8 tokens, p-7..p; the first 8 positions see no difference.
    assert torch.allclose(windowed[:8], full[:8], atol=ATOL)
    assert (windowed[8:] - full[8:]).abs().amax(-1).min() > 1e-2


def test_sharded_folder_matches_transformers(tiny_model_dir):
    sharded = tiny_model_dir("qwen2", shards=3)
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) >= 2
    ids = random_prompt(40, seed=3)
    ours = reference_logits(load_model_ir(sharded), ids)
    assert_logits_match(ours, hf_logits(sharded, ids), what="qwen2 sharded")
    # And the same weights unsharded give the same numbers.
    single = reference_logits(load_model_ir(tiny_model_dir("qwen2")), ids)
    assert torch.equal(ours, single)


# ------------------------------------------------------------------------ GGUF files
GGUF_VARIANTS = ["llama", "llama-tied", "qwen2"]


@pytest.mark.parametrize("variant", GGUF_VARIANTS + list(FAMILY_VARIANTS))
def test_gguf_f32_weights_equal_hf_weights(tiny_model_dir, tiny_gguf, variant):
    """Names map to HF names and Q/K rows come back un-permuted, bit for bit (experts sliced
    out of their stacks; Gemma's norms 1 + w on both sides); every tensor is one the family reads."""
    hf = load_model_ir(tiny_model_dir(variant))
    gg = load_model_ir(tiny_gguf(variant, "F32"))
    hf_names, gg_names = set(hf.weights.names()), set(gg.weights.names())
    # A tied HF checkpoint stores no lm_head; neither does its GGUF (no output.weight).
    assert hf_names == gg_names, f"only in HF: {hf_names - gg_names}; only in GGUF: {gg_names - hf_names}"
    assert set(gg.check_weights()) == gg_names
    for name in sorted(hf_names):
        a, b = hf.weights.get(name), gg.weights.get(name)
        assert a.dtype == b.dtype == torch.float32, name
        assert a.shape == b.shape, f"{name}: {tuple(a.shape)} vs {tuple(b.shape)}"
        assert torch.equal(a, b), f"{name}: GGUF tensor differs from HF (max {float((a - b).abs().max()):.3g})"


@pytest.mark.parametrize("variant", GGUF_VARIANTS + ["llama-rope-linear"])
def test_gguf_f32_matches_transformers(tiny_model_dir, tiny_gguf, variant):
    ids = random_prompt(40, seed=4)
    ours = reference_logits(load_model_ir(tiny_gguf(variant, "F32")), ids)
    assert_logits_match(ours, hf_logits(tiny_model_dir(variant), ids), what=f"{variant} GGUF F32")


def test_gguf_llama3_rope_matches_transformers(tiny_model_dir, tiny_gguf):
    """llama.cpp writes no rope-scaling keys for llama3 rope; it stores the per-frequency
    divisors as a `rope_freqs.weight` tensor, which a loader must apply."""
    ids = random_prompt(40, seed=4)
    ours = reference_logits(load_model_ir(tiny_gguf("llama3-rope", "F32")), ids)
    assert_logits_match(ours, hf_logits(tiny_model_dir("llama3-rope"), ids), what="llama3-rope GGUF F32")


@pytest.mark.parametrize("qtype", ["F16", "Q8_0"])
@pytest.mark.parametrize("variant", GGUF_VARIANTS)
def test_gguf_quantized_matches_roundtripped_hf(tiny_gguf, tiny_roundtrip_dir, tiny_model_dir, variant, qtype):
    """Against the original HF weights a Q8_0 file is off by ~0.2-0.3 in the logits (that is
    the quantization, not a bug), so the oracle is the HF model with each weight quantized and
    dequantized exactly as the file stores it; then 1e-4 holds again."""
    ids = random_prompt(40, seed=5)
    ours = reference_logits(load_model_ir(tiny_gguf(variant, qtype)), ids)
    assert_logits_match(ours, hf_logits(tiny_roundtrip_dir(variant, qtype), ids), what=f"{variant} GGUF {qtype}")
    # Sanity: quantization really happened and stays modest against the unquantized model.
    drift = (ours - hf_logits(tiny_model_dir(variant), ids)).abs().max().item()
    assert 0 < drift < (0.05 if qtype == "F16" else 1.0), f"{qtype} drift {drift}"


# ------------------------------------------------------------------------ SmolLM2 (real model)
@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf):
    """transformers' own loading of the same GGUF (dequantized to float32; ~20 s)."""
    pytest.importorskip("accelerate", reason="transformers' GGUF loading needs accelerate (test extra)")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32,
        attn_implementation="eager")
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_ir(smollm2_gguf):
    return load_model_ir(smollm2_gguf)


def test_smollm2_config(smollm2_ir):
    cfg = smollm2_ir.config
    assert cfg.family == "llama"
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (49152, 576, 1536)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert cfg.tie_word_embeddings is True
    assert cfg.rope_theta == 100000.0 and cfg.rope_scaling is None
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)


def test_smollm2_gguf_matches_transformers_gguf(smollm2_ir, smollm2_hf):
    tok = smollm2_ir.load_tokenizer()
    ids = tok("The capital of France is").input_ids
    assert 3 <= len(ids) <= 12
    ours = reference_logits(smollm2_ir, ids)
    with torch.no_grad():
        ref = smollm2_hf(input_ids=torch.tensor([ids])).logits[0].float()
    assert_logits_match(ours, ref, what="SmolLM2 Q4_1 GGUF")
    assert tok.decode(int(ours[-1].argmax())).strip() == "Paris"
