"""Mixtral: the Llama decoder with a sparse MoE block on every layer (softmax
router, top-k, renormalised over the chosen experts). Its checkpoints name
the experts block_sparse_moe.experts.{e}.w1/w3/w2 (gate/up/down); llama.cpp
writes it as arch "llama" with experts, which the llama module reads."""
from __future__ import annotations

from hetero_sd.ir.config import ModelConfig, MoEConfig
from hetero_sd.ir.families import llama
from hetero_sd.ir.families.llama import gguf_fixup, gguf_name_map, hf_fixup, weight_names  # noqa: F401

__getattr__ = llama.__getattr__  # Forward: the shared reference forward
HF_MODEL_TYPES = ("mixtral",)
GGUF_ARCHS = ()  # "llama" with expert_count: llama.config_from_gguf names this family


def config_from_hf(hf: dict) -> ModelConfig:
    moe = MoEConfig(num_experts=int(llama.need(hf, "num_local_experts")),
                    experts_per_token=int(llama.need(hf, "num_experts_per_tok")),
                    intermediate_size=int(llama.need(hf, "intermediate_size")), normalize_topk=True,
                    layers=tuple(range(llama.need(hf, "num_hidden_layers"))))
    return llama.config_from_hf(hf, "mixtral", moe=moe)


def config_from_gguf(fields: dict, arch: str, tensor_names: set[str], vector) -> ModelConfig:
    return llama.config_from_gguf(fields, arch, tensor_names, vector)


_EXPERT = {"gate": "w1", "up": "w3", "down": "w2"}


def hf_aliases(cfg: ModelConfig) -> dict[str, str]:
    out = {}
    for i in cfg.moe.layers:
        p = f"model.layers.{i}."
        out[p + "mlp.gate.weight"] = p + "block_sparse_moe.gate.weight"
        for e in range(cfg.moe.num_experts):
            for ours, theirs in _EXPERT.items():
                out[p + f"mlp.experts.{e}.{ours}_proj.weight"] = p + f"block_sparse_moe.experts.{e}.{theirs}.weight"
    return out
