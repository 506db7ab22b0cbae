"""Every family variant as llama.cpp's converter writes it (helpers/gguf_families.py) reads back
as the model its HF folder holds: the same weights under HF names (Q/K un-permuted, experts
sliced out of their stacks, Gemma's stored 1 + w equal to the folder's 1 + w: in
test_reference_parity.py, over every variant), the same logits
as transformers, and the family's features in the config from the GGUF metadata alone.

Gemma 3's tiny variant has Gemma's own pattern, five windowed layers then a global one: the
pattern llama.cpp assumes of a GGUF (its converter writes no key for it), so the file says
everything the model is.
"""
from __future__ import annotations

import dataclasses
import math

import pytest

from helpers.logits import assert_logits_match
from helpers.tiny_models import FAMILY_VARIANTS, NUM_EXPERTS, hf_logits, make_roundtrip_hf, random_prompt
from hetero_sd.ir import load_model_ir, reference_logits

# What each family's GGUF metadata must give (beyond what every family has).
FEATURES = {
    "qwen3": dict(family="qwen3", qk_norm=True, moe=None),
    "qwen3-moe": dict(family="qwen3_moe", qk_norm=True),
    "mixtral": dict(family="mixtral", qk_norm=False),
    "gemma3": dict(family="gemma3", qk_norm=True, sandwich_norms=True, hidden_act="gelu_tanh",
                   local_rope_theta=10000.0, rope_theta=1000000.0, final_softcap=10.0, sliding_window=8,
                   rope_scaling={"rope_type": "linear", "factor": 2.0}, tie_word_embeddings=True),
    "phi3": dict(family="phi3", rotary_dim=8, fused_qkv=True, fused_gate_up=True, sliding_window=None),
    "smollm3": dict(family="smollm3", nope_layers=(3,)),
}


@pytest.mark.parametrize("variant", FAMILY_VARIANTS)
def test_gguf_f32_matches_transformers(tiny_model_dir, tiny_gguf, variant):
    ids = random_prompt(40, seed=1)
    ours = reference_logits(load_model_ir(tiny_gguf(variant, "F32")), ids)
    assert_logits_match(ours, hf_logits(tiny_model_dir(variant), ids), what=f"{variant} GGUF F32")


@pytest.mark.parametrize("variant", FAMILY_VARIANTS)
def test_gguf_q8_0_matches_roundtripped_hf(tiny_model_dir, tiny_gguf, tmp_path, variant):
    """The oracle is the HF model with each weight stored as the file stores it and back
    (make_roundtrip_hf); the router and norms stay F32, the experts quantize row by row."""
    oracle = make_roundtrip_hf(tiny_model_dir(variant), tmp_path / f"{variant}-Q8_0", "Q8_0")
    ids = random_prompt(40, seed=1)
    gg = load_model_ir(tiny_gguf(variant, "Q8_0"))
    assert gg.weights.type_name("model.layers.0.self_attn.o_proj.weight") == "Q8_0"
    if gg.config.moe is not None:
        assert gg.weights.type_name("model.layers.0.mlp.experts.1.down_proj.weight") == "Q8_0"
        assert gg.weights.type_name("model.layers.0.mlp.gate.weight") == "F32"
    assert_logits_match(reference_logits(gg, ids), hf_logits(oracle, ids), what=f"{variant} GGUF Q8_0")


@pytest.mark.parametrize("variant", FAMILY_VARIANTS)
def test_gguf_config_has_the_family_features(tiny_model_dir, tiny_gguf, variant):
    """The features listed in FEATURES, and every other field as the HF folder's config has it
    (the metadata stores the norm epsilon as float32)."""
    cfg = load_model_ir(tiny_gguf(variant, "F32")).config
    hf = load_model_ir(tiny_model_dir(variant)).config
    for field, want in FEATURES[variant].items():
        assert getattr(cfg, field) == want, f"{variant}: {field} = {getattr(cfg, field)!r}, want {want!r}"
    if variant in ("qwen3-moe", "mixtral"):
        assert cfg.moe is not None and cfg.moe.num_experts == NUM_EXPERTS == 4
        assert cfg.moe == hf.moe
    if variant == "phi3":
        sc = cfg.rope_scaling
        assert sc["rope_type"] == "longrope" and sc["original_max_position_embeddings"] == 64
        assert sc["short_factor"] == hf.rope_scaling["short_factor"]
        assert sc["long_factor"] == hf.rope_scaling["long_factor"]
        # the converter's attn_factor for longrope: sqrt(1 + ln(256 / 64) / ln(64)), stored float32
        assert sc["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(4) / math.log(64)), rel=1e-7)
    assert cfg.rms_norm_eps == pytest.approx(hf.rms_norm_eps, rel=1e-6)
    skip = {"rms_norm_eps"} | ({"rope_scaling"} if variant == "phi3" else set())
    differ = {f.name: (getattr(cfg, f.name), getattr(hf, f.name)) for f in dataclasses.fields(cfg)
              if f.name not in skip and getattr(cfg, f.name) != getattr(hf, f.name)}
    assert not differ, f"{variant}: GGUF config differs from the HF folder's (gguf, hf): {differ}"


def test_gguf_gemma3_layer_windows(tiny_gguf):
    assert load_model_ir(tiny_gguf("gemma3", "F32")).config.layer_windows == (8, 8, 8, 8, 8, None)


def test_gguf_gemma3_pattern_key_overrides():
    """llama.cpp's loader takes a sliding_window_pattern key (a number or one flag per
    layer) where a file has one; so does ours."""
    from hetero_sd.ir.families import gemma3

    fields = {"gemma3.block_count": 6, "gemma3.embedding_length": 64, "gemma3.attention.head_count": 4,
              "gemma3.feed_forward_length": 128, "gemma3.attention.sliding_window": 8, "gemma3.vocab_size": 384}
    for pattern, want in ((2, (8, None) * 3), ([True, False, False, True, True, True], (8, None, None, 8, 8, 8))):
        cfg = gemma3.config_from_gguf({**fields, "gemma3.attention.sliding_window_pattern": pattern}, "gemma3",
                                      set(), lambda name: None)
        assert cfg.layer_windows == want


def test_gguf_missing_expert_tensor_is_named(tiny_model_dir, tmp_path):
    """A stacked expert tensor missing from the file: the error names it (HF and GGUF names)."""
    from helpers.tiny_models import make_gguf

    path = make_gguf(tiny_model_dir("qwen3-moe"), tmp_path / "cut" / "cut.gguf", "F32",
                     drop=("blk.1.ffn_up_exps.weight",))
    ir = load_model_ir(path)
    from hetero_sd.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.experts\.0\.up_proj\.weight"):
        ir.check_weights()


@pytest.mark.parametrize("variant,key", [("qwen3-moe", "qwen3moe.expert_feed_forward_length"),
                                         ("mixtral", "llama.expert_used_count"),
                                         ("phi3", "phi3.rope.scaling.original_context_length")])
def test_gguf_missing_family_key_names_file_and_key(tiny_model_dir, tmp_path, variant, key):
    from hetero_sd.errors import ModelLoadError
    from helpers.tiny_models import make_gguf

    path = make_gguf(tiny_model_dir(variant), tmp_path / "cut" / "cut.gguf", "F32", drop_keys=(key,))
    with pytest.raises(ModelLoadError) as err:
        load_model_ir(path)
    assert "cut.gguf" in str(err.value) and repr(key) in str(err.value)
