"""Every family module against transformers: the reference forward's logits,
greedy generation, what each family adds (each guarded: switched off, the
answer changes), and clear errors for configs a family cannot read.

The tiny variants (helpers/tiny_models.py FAMILY_VARIANTS) carry what each
family adds: Qwen3's q/k norms; Qwen3-MoE's and Mixtral's 4 experts, top-2
(and a mixed dense/sparse, unnormalised Qwen3-MoE); Gemma 3's windowed layer
(window 8) beside a global one with its own scaled RoPE, four norms, scaled
embedding, GeGLU and soft-capped logits; Phi-3's fused projections, RoPE on
half of each head and longrope factors; SmolLM3's NoPE layer."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from helpers.tiny_models import FAMILY_VARIANTS, HF_ONLY_VARIANTS, hf_generate, hf_logits, random_prompt
from hetero_sd.errors import ModelLoadError
from hetero_sd.ir import families, load_model_ir, reference_logits
from helpers.logits import assert_logits_match

ALL = FAMILY_VARIANTS + HF_ONLY_VARIANTS
FAMILY_OF = {"qwen3": "qwen3", "qwen3-moe": "qwen3_moe", "qwen3-moe-mixed": "qwen3_moe", "mixtral": "mixtral",
             "gemma3": "gemma3", "phi3": "phi3", "smollm3": "smollm3"}


@pytest.mark.parametrize("variant", ALL)
def test_reference_matches_transformers(tiny_model_dir, variant):
    folder = tiny_model_dir(variant)
    ir = load_model_ir(folder)
    assert ir.config.family == FAMILY_OF[variant]
    ids = random_prompt(40, seed=1)  # 5x Gemma's window; below Phi-3's longrope switch (64)
    assert_logits_match(reference_logits(ir, ids), hf_logits(folder, ids), what=variant)


def _our_greedy(ir, prompt, n):
    """Greedy through the reference forward with its KV cache, one token per call."""
    cfg = ir.config
    forward = ir.family.Forward(cfg, dict(ir.iter_weights()), torch.float32)
    shape = (cfg.num_layers, cfg.num_kv_heads, len(prompt) + n, cfg.head_dim)
    k, v = torch.zeros(shape), torch.zeros(shape)
    with torch.inference_mode():
        logits = forward(torch.tensor(prompt), 0, k, v)
        out = [int(logits[-1].argmax())]
        while len(out) < n:
            logits = forward(torch.tensor(out[-1:]), len(prompt) + len(out) - 1, k, v)
            out.append(int(logits[-1].argmax()))
    return out


@pytest.mark.parametrize("variant", ALL)
def test_greedy_equals_transformers_generate(tiny_model_dir, variant):
    folder = tiny_model_dir(variant)
    prompt = random_prompt(9, seed=4)
    want = hf_generate(folder, prompt, 20)  # shorter where it ends at the end token
    assert len(want) >= 5 and _our_greedy(load_model_ir(folder), prompt, 20)[:len(want)] == want


# What each family adds, switched off: the logits must move (else the parity test proves nothing).
GUARDS = [
    ("qwen3", {"qk_norm": False}),
    ("gemma3", {"sandwich_norms": False}), ("gemma3", {"embed_scale": None}), ("gemma3", {"final_softcap": None}),
    ("gemma3", {"local_rope_theta": None}), ("gemma3", {"layer_windows": None}), ("gemma3", {"hidden_act": "silu"}),
    ("gemma3", {"query_scale": 0.5}),  # the test model's query_pre_attn_scalar is head_dim: another must matter
    ("phi3", {"rope_scaling": None}), ("phi3", {"rotary_dim": None, "rope_scaling": None}),
    ("smollm3", {"nope_layers": ()}),
]


@pytest.mark.parametrize("variant,change", GUARDS, ids=[f"{v}-{'+'.join(c)}" for v, c in GUARDS])
def test_each_family_feature_changes_the_answer(tiny_model_dir, variant, change):
    ir = load_model_ir(tiny_model_dir(variant))
    ids = random_prompt(40, seed=1)
    base = reference_logits(ir, ids)
    ir.config = dataclasses.replace(ir.config, **change)
    assert (reference_logits(ir, ids) - base).abs().max() > 1e-2, f"{variant}: {change} changes nothing"


@pytest.mark.parametrize("variant", ["qwen3-moe", "mixtral"])
def test_moe_routing_matters_and_normalisation(tiny_model_dir, variant):
    """Top-1 instead of top-2, or unnormalised weights, give other logits."""
    ir = load_model_ir(tiny_model_dir(variant))
    ids = random_prompt(40, seed=1)
    base = reference_logits(ir, ids)
    for change in ({"experts_per_token": 1}, {"normalize_topk": False}):
        ir.config = dataclasses.replace(ir.config, moe=dataclasses.replace(load_model_ir(
            tiny_model_dir(variant)).config.moe, **change))
        assert (reference_logits(ir, ids) - base).abs().max() > 1e-2, change


def test_mixed_moe_has_dense_and_sparse_layers(tiny_model_dir):
    cfg = load_model_ir(tiny_model_dir("qwen3-moe-mixed")).config
    assert cfg.moe.layers == (1,) and not cfg.moe.normalize_topk
    assert cfg.sparse(1) and not cfg.sparse(0)


def test_longrope_switches_factors_past_the_original_context(tiny_model_dir):
    """Below original_max_position_embeddings (64) transformers and we agree; past
    it the long factors apply to those positions (transformers switches a whole
    call once it reaches past 64, so there the two are not compared)."""
    from hetero_sd.ir.families.decoder import rope_cos_sin

    cfg = load_model_ir(tiny_model_dir("phi3")).config
    cos, _ = rope_cos_sin(cfg, torch.arange(128))
    short = dataclasses.replace(cfg, rope_scaling={**cfg.rope_scaling, "long_factor": cfg.rope_scaling["short_factor"]})
    cos_short, _ = rope_cos_sin(short, torch.arange(128))
    assert torch.equal(cos[:64], cos_short[:64]) and not torch.equal(cos[64:], cos_short[64:])


# ------------------------------------------------------------------ bad input
def _edit_config(tiny_model_dir, tmp_path, variant, edit):
    import shutil

    folder = tmp_path / variant
    shutil.copytree(tiny_model_dir(variant), folder)
    cfg = json.loads((folder / "config.json").read_text())
    edit(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_unknown_model_type_names_file_and_supported(tiny_model_dir, tmp_path):
    folder = _edit_config(tiny_model_dir, tmp_path, "qwen3", lambda c: c.update(model_type="qwen3_next"))
    with pytest.raises(ModelLoadError) as err:
        load_model_ir(folder)
    msg = str(err.value)
    assert "config.json" in msg and "qwen3_next" in msg
    for known in ("qwen3", "qwen3_moe", "mixtral", "gemma3_text", "phi3", "smollm3", "llama"):
        assert known in msg


@pytest.mark.parametrize("variant,key", [("qwen3-moe", "moe_intermediate_size"), ("mixtral", "num_local_experts"),
                                         ("gemma3", "query_pre_attn_scalar"), ("qwen3", "num_attention_heads"),
                                         ("phi3", "original_max_position_embeddings")])
def test_missing_key_names_file_and_key(tiny_model_dir, tmp_path, variant, key):
    def drop(cfg):
        cfg.pop(key)
        if key == "original_max_position_embeddings":
            cfg.get("rope_parameters", {}).pop(key, None)

    folder = _edit_config(tiny_model_dir, tmp_path, variant, drop)
    with pytest.raises(ModelLoadError) as err:
        load_model_ir(folder)
    assert "config.json" in str(err.value) and repr(key) in str(err.value)


def test_unsupported_activation_is_named(tiny_model_dir, tmp_path):
    folder = _edit_config(tiny_model_dir, tmp_path, "gemma3", lambda c: c.update(hidden_activation="relu"))
    with pytest.raises(ModelLoadError, match="hidden_activation 'relu'"):
        load_model_ir(folder)


def test_every_family_is_registered_with_its_names():
    hf = {t for m in families.FAMILIES.values() for t in m.HF_MODEL_TYPES}
    gguf = {a for m in families.FAMILIES.values() for a in m.GGUF_ARCHS}
    assert {"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gemma3_text", "phi3", "smollm3"} <= hf
    assert {"llama", "qwen2", "qwen3", "qwen3moe", "gemma3", "phi3", "smollm3"} <= gguf
