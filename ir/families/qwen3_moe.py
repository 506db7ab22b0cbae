"""Qwen3-MoE: Qwen3's attention, and sparse MoE blocks (softmax router, top-k,
optionally renormalised) on the layers decoder_sparse_step and mlp_only_layers
leave sparse; the others keep a dense MLP."""
from __future__ import annotations

from hetero_sd.ir.config import ModelConfig, MoEConfig
from hetero_sd.ir.families import llama
from hetero_sd.ir.families.llama import (  # noqa: F401  (the family's names, shared)
    gguf_fixup, gguf_name_map, hf_aliases, hf_fixup, weight_names)

__getattr__ = llama.__getattr__  # Forward: the shared reference forward
HF_MODEL_TYPES = ("qwen3_moe",)
GGUF_ARCHS = ("qwen3moe",)


def config_from_hf(hf: dict) -> ModelConfig:
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if experts is None:
        llama.need(hf, "num_experts")
    layers = llama.need(hf, "num_hidden_layers")
    step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
    moe = MoEConfig(num_experts=int(experts), experts_per_token=int(llama.need(hf, "num_experts_per_tok")),
                    intermediate_size=int(llama.need(hf, "moe_intermediate_size")),
                    normalize_topk=bool(hf.get("norm_topk_prob", False)),
                    layers=tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0))
    return llama.config_from_hf(hf, "qwen3_moe", qk_norm=True, moe=moe)


def config_from_gguf(fields: dict, arch: str, tensor_names: set[str], vector) -> ModelConfig:
    moe = llama.moe_from_gguf(fields, arch, "expert_feed_forward_length")
    return llama.config_from_gguf(fields, arch, tensor_names, vector, family="qwen3_moe", qk_norm=True, moe=moe)
