"""Phi-3 / Phi-4-mini: the Llama decoder with q, k and v in one qkv_proj and
gate and up in one gate_up_proj, RoPE on a fraction of each head
(partial_rotary_factor) and longrope scaling (short and long factors)."""
from __future__ import annotations

from hetero_sd.ir.config import ModelConfig
from hetero_sd.ir.families import llama
from hetero_sd.ir.families.llama import (  # noqa: F401  (the family's names, shared)
    gguf_fixup, gguf_name_map, hf_aliases, hf_fixup, weight_names)

__getattr__ = llama.__getattr__  # Forward: the shared reference forward
HF_MODEL_TYPES = ("phi3",)
GGUF_ARCHS = ("phi3",)
_FUSED = dict(fused_qkv=True, fused_gate_up=True)


def config_from_hf(hf: dict) -> ModelConfig:
    cfg = llama.config_from_hf(hf, "phi3", supported_rope=llama.SUPPORTED_ROPE + ("longrope", "su"), **_FUSED)
    sc = cfg.rope_scaling
    if sc is not None and sc["rope_type"] in ("longrope", "su"):
        sc = {**sc, "rope_type": "longrope"}
        sc.setdefault("original_max_position_embeddings", llama.need(hf, "original_max_position_embeddings"))
        return llama.dataclasses.replace(cfg, rope_scaling=sc)
    return cfg


def config_from_gguf(fields: dict, arch: str, tensor_names: set[str], vector) -> ModelConfig:
    get = llama.gguf_getter(fields, arch)
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = hidden // heads
    rot = int(get("rope.dimension_count", head_dim))
    extra = dict(_FUSED, rotary_dim=rot if rot != head_dim else None)
    long, short = vector("rope_factors_long.weight"), vector("rope_factors_short.weight")
    if long is not None and short is not None:
        extra["rope_scaling"] = {
            "rope_type": "longrope", "long_factor": list(long), "short_factor": list(short),
            "original_max_position_embeddings": int(get("rope.scaling.original_context_length")),
            "attention_factor": float(get("rope.scaling.attn_factor", 0.0)) or None}
    # llama.cpp turns Phi-3's sliding window off (phi3.cpp); so does this reading.
    return llama.config_from_gguf(fields, arch, tensor_names, vector, family="phi3", **extra)
