"""The decoder every family shares: weight names, GGUF tensor names, RoPE and
the reference forward that defines what every backend must compute.

A family module parses its config into a ModelConfig (ir/config.py); what
families differ in (q/k norms, Gemma's four norms, per-layer windows and RoPE
bases, NoPE layers, fused projections, mixtures of experts) is a field there,
so one forward and one lowering per backend serve them all.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from hetero_sd.ir.config import ModelConfig

if TYPE_CHECKING:  # RoPE and the forward make tensors; reading a config imports no torch
    import torch


# ---------------------------------------------------------------- names
def qkv_names(cfg: ModelConfig, p: str) -> list[str]:
    """The weights whose rows, stacked, give q, k and v (in that order)."""
    if cfg.fused_qkv:
        return [p + "self_attn.qkv_proj.weight"]
    return [p + f"self_attn.{n}_proj.weight" for n in "qkv"]


def gate_up_names(p: str, cfg: ModelConfig, expert: int | None = None) -> list[str]:
    """The weights whose rows, stacked, give the gated MLP's gate and up halves."""
    if expert is not None:
        return [p + f"mlp.experts.{expert}.{n}_proj.weight" for n in ("gate", "up")]
    if cfg.fused_gate_up:
        return [p + "mlp.gate_up_proj.weight"]
    return [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]


def down_name(p: str, expert: int | None = None) -> str:
    return p + (f"mlp.experts.{expert}.down_proj.weight" if expert is not None else "mlp.down_proj.weight")


def norm_names(cfg: ModelConfig, p: str) -> list[str]:
    names = [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    if cfg.sandwich_norms:
        names += [p + "pre_feedforward_layernorm.weight", p + "post_feedforward_layernorm.weight"]
    if cfg.qk_norm:
        names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
    return names


def weight_names(cfg: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names += norm_names(cfg, p) + qkv_names(cfg, p) + [p + "self_attn.o_proj.weight"]
        if cfg.attention_bias:
            names += [p + f"self_attn.{n}_proj.bias" for n in "qkv"]
        if cfg.sparse(i):
            names.append(p + "mlp.gate.weight")
            for e in range(cfg.moe.num_experts):
                names += gate_up_names(p, cfg, e) + [down_name(p, e)]
        else:
            names += gate_up_names(p, cfg) + [down_name(p)]
    return names


_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
}
_GGUF_FUSED_QKV = {"self_attn.qkv_proj.weight": "attn_qkv.weight"}
_GGUF_FUSED_GATE_UP = {"mlp.gate_up_proj.weight": "ffn_up.weight"}  # llama.cpp keeps Phi-3's gate|up as ffn_up
# Gemma's four norms: llama.cpp names the one before the MLP ffn_norm.
_GGUF_SANDWICH = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


def gguf_name_map(cfg: ModelConfig) -> dict[str, str | tuple[str, int]]:
    """HF name -> GGUF name, or (GGUF name, index) for one expert's slice of a
    stacked [experts, rows, cols] tensor."""
    out = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    layer = {**_GGUF_LAYER, **(_GGUF_SANDWICH if cfg.sandwich_norms else {}),
             **(_GGUF_FUSED_QKV if cfg.fused_qkv else {})}
    if cfg.fused_gate_up:
        layer = {k: v for k, v in layer.items() if k != "mlp.up_proj.weight"} | _GGUF_FUSED_GATE_UP
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for hf, gg in layer.items():
            out[p + hf] = f"blk.{i}.{gg}"
        if cfg.sparse(i):
            out[p + "mlp.gate.weight"] = f"blk.{i}.ffn_gate_inp.weight"
            for e in range(cfg.moe.num_experts):
                for n in ("gate", "up", "down"):
                    out[p + f"mlp.experts.{e}.{n}_proj.weight"] = (f"blk.{i}.ffn_{n}_exps.weight", e)
    return out


# ---------------------------------------------------------------- RoPE
def rope_inv_freq(cfg: ModelConfig, local: bool = False, long: bool = False) -> "torch.Tensor":
    """Inverse frequencies of the first rope_dim of a head. `local`: the
    windowed layers' own unscaled base (Gemma 3); `long`: longrope's long factors."""
    import torch

    dim = cfg.rope_dim
    theta = cfg.local_rope_theta if local else cfg.rope_theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    sc = None if local else cfg.rope_scaling
    if sc is not None and sc["rope_type"] == "longrope":
        ext = torch.tensor(sc["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (ext * theta ** exponents)
    inv = 1.0 / (theta ** exponents)
    if local:
        return inv
    if cfg.rope_freq_factors is not None:  # GGUF stores llama3 scaling as divisors
        return inv / torch.tensor(cfg.rope_freq_factors, dtype=torch.float32)
    if sc is None:
        return inv
    if sc["rope_type"] == "linear":
        return inv / sc["factor"]
    # llama3: keep high frequencies, divide low ones by factor, blend between.
    factor, old = sc["factor"], sc["original_max_position_embeddings"]
    low_wl, high_wl = old / sc["low_freq_factor"], old / sc["high_freq_factor"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wl, inv / factor, inv)
    smooth = (old / wavelen - sc["low_freq_factor"]) / (sc["high_freq_factor"] - sc["low_freq_factor"])
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wl) * ~(wavelen > low_wl)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(cfg: ModelConfig, positions: "torch.Tensor", local: bool = False):
    """float32 cos and sin [n, rope_dim] at integer `positions`.

    longrope (Phi-3): positions below original_max_position_embeddings take the
    short factors, later ones the long, every one scaled by the attention
    factor. transformers instead switches every position of a call to the long
    factors once the call reaches past that length, so the two agree up to it."""
    import torch

    pos = positions.to(torch.float32)[:, None]
    sc = None if local else cfg.rope_scaling
    scale = 1.0
    if sc is not None and sc["rope_type"] == "longrope":
        old = sc["original_max_position_embeddings"]
        factor = sc.get("factor") or cfg.max_position_embeddings / old
        scale = sc.get("attention_factor") or (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old)))
        freqs = torch.where(pos < old, pos * rope_inv_freq(cfg)[None, :], pos * rope_inv_freq(cfg, long=True)[None, :])
    else:
        freqs = pos * rope_inv_freq(cfg, local)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scale, emb.sin() * scale


def _rotate_half(x: "torch.Tensor") -> "torch.Tensor":
    import torch

    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: "torch.Tensor", cos: "torch.Tensor", sin: "torch.Tensor") -> "torch.Tensor":
    import torch

    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot, rest = x[..., :rd], x[..., rd:]
    return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)


def activation(name: str):
    import torch.nn.functional as F

    return {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}[name]

