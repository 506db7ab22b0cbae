"""Gemma 3 (text): windowed layers with their own RoPE base between global
ones (every sixth by default), four RMSNorms per layer with q/k norms, the
embedding scaled by sqrt(hidden), GeGLU (tanh GELU), query_pre_attn_scalar
as the score scale, and logit soft-capping where the config has it.

Gemma checkpoints store each norm weight as an offset from one; the IR holds
the multiplier (1 + w, the sum transformers computes), which is what
llama.cpp's converter writes to a GGUF, so both read the same numbers."""
from __future__ import annotations

import math

from hetero_sd.ir.config import ModelConfig
from hetero_sd.ir.errors import ModelLoadError
from hetero_sd.ir.families import llama
from hetero_sd.ir.families.llama import gguf_fixup, gguf_name_map, hf_aliases, weight_names  # noqa: F401

__getattr__ = llama.__getattr__  # Forward: the shared reference forward
HF_MODEL_TYPES = ("gemma3_text",)
GGUF_ARCHS = ("gemma3",)
_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def _pattern_types(layers: int, pattern: int) -> list[str]:
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]


def config_from_hf(hf: dict) -> ModelConfig:
    layers, hidden = llama.need(hf, "num_hidden_layers"), llama.need(hf, "hidden_size")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _ACTIVATIONS:
        raise ModelLoadError(f"hidden_activation {act!r} is not supported; supported: {', '.join(_ACTIVATIONS)}")
    params = hf.get("rope_parameters") or {}
    # transformers 5: RoPE per layer type; older configs: rope_theta/rope_scaling plus rope_local_base_freq.
    full = params.get("full_attention") or {"rope_theta": hf.get("rope_theta", 1e6), **(hf.get("rope_scaling") or {})}
    local = params.get("sliding_attention") or {"rope_theta": hf.get("rope_local_base_freq", 10000.0)}
    types = hf.get("layer_types") or _pattern_types(layers, int(hf.get("sliding_window_pattern", 6)))
    flat = {k: v for k, v in hf.items() if k not in ("rope_theta", "rope_scaling")}
    flat.update(rope_parameters=full, layer_types=types)
    flat.setdefault("tie_word_embeddings", True)
    return llama.config_from_hf(
        flat, "gemma3", qk_norm=True, sandwich_norms=True, hidden_act=_ACTIVATIONS[act],
        embed_scale=math.sqrt(hidden), query_scale=float(llama.need(hf, "query_pre_attn_scalar")) ** -0.5,
        attn_softcap=hf.get("attn_logit_softcapping"), final_softcap=hf.get("final_logit_softcapping"),
        local_rope_theta=float(local["rope_theta"]))


def hf_fixup(cfg: ModelConfig):
    def one_plus(name: str, tensor):
        return 1.0 + tensor if name.endswith("norm.weight") else tensor
    return one_plus


def config_from_gguf(fields: dict, arch: str, tensor_names: set[str], vector) -> ModelConfig:
    get = llama.gguf_getter(fields, arch)
    layers, hidden, heads = int(get("block_count")), int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    window = fields.get(f"{arch}.attention.sliding_window")
    # llama.cpp's converter writes no pattern: its loader then takes every sixth
    # layer as global (a pattern key, a number or one flag per layer, overrides);
    # its score scale is 1/sqrt(head_dim) but for the 27B's (62 layers) hidden/heads.
    pattern = fields.get(f"{arch}.attention.sliding_window_pattern", 6)
    if isinstance(pattern, (int, float)):
        sliding = [t == "sliding_attention" for t in _pattern_types(layers, int(pattern))]
    else:
        sliding = [bool(flag) for flag in pattern]
    windows = tuple(int(window) if s else None for s in sliding) if window else None
    return llama.config_from_gguf(
        fields, arch, tensor_names, vector, family="gemma3", qk_norm=True, sandwich_norms=True,
        hidden_act="gelu_tanh", embed_scale=math.sqrt(hidden),
        query_scale=(hidden / heads if layers == 62 else head_dim) ** -0.5,
        final_softcap=fields.get(f"{arch}.final_logit_softcapping"), layer_windows=windows,
        sliding_window=int(window) if window else None,
        local_rope_theta=float(get("rope.freq_base_swa", 10000.0)))
