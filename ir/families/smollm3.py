"""SmolLM3: the Llama decoder with some layers attending without RoPE (NoPE:
no_rope_layers, by default every fourth)."""
from __future__ import annotations

from hetero_sd.ir.config import ModelConfig
from hetero_sd.ir.families import llama
from hetero_sd.ir.families.llama import (  # noqa: F401  (the family's names, shared)
    gguf_fixup, gguf_name_map, hf_aliases, hf_fixup, weight_names)

__getattr__ = llama.__getattr__  # Forward: the shared reference forward
HF_MODEL_TYPES = ("smollm3",)
GGUF_ARCHS = ("smollm3",)


def _every(interval: int, layers: int) -> tuple[int, ...]:
    return tuple(i for i in range(layers) if (i + 1) % interval == 0)


def config_from_hf(hf: dict) -> ModelConfig:
    layers = llama.need(hf, "num_hidden_layers")
    flags = hf.get("no_rope_layers")
    if flags is None:
        nope = _every(int(hf.get("no_rope_layer_interval", 4)), layers)
    else:
        nope = tuple(i for i, use_rope in enumerate(flags) if not use_rope)
    return llama.config_from_hf(hf, "smollm3", nope_layers=nope)


def config_from_gguf(fields: dict, arch: str, tensor_names: set[str], vector) -> ModelConfig:
    # llama.cpp writes no NoPE key: it runs every fourth layer without RoPE (smollm3.cpp).
    layers = int(llama.gguf_getter(fields, arch)("block_count"))
    return llama.config_from_gguf(fields, arch, tensor_names, vector, family="smollm3",
                                  nope_layers=_every(4, layers))
