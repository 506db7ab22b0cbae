"""Qwen3 (dense): the Llama decoder with an RMSNorm over each head's q and k
before RoPE, and no q/k/v biases."""
from __future__ import annotations

from hetero_sd.ir.config import ModelConfig
from hetero_sd.ir.families import llama
from hetero_sd.ir.families.llama import (  # noqa: F401  (the family's names, shared)
    gguf_fixup, gguf_name_map, hf_aliases, hf_fixup, weight_names)

__getattr__ = llama.__getattr__  # Forward: the shared reference forward
HF_MODEL_TYPES = ("qwen3",)
GGUF_ARCHS = ("qwen3",)


def config_from_hf(hf: dict) -> ModelConfig:
    return llama.config_from_hf(hf, "qwen3", qk_norm=True)


def config_from_gguf(fields: dict, arch: str, tensor_names: set[str], vector) -> ModelConfig:
    return llama.config_from_gguf(fields, arch, tensor_names, vector, family="qwen3", qk_norm=True)
