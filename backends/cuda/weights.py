"""Streaming a model's weights onto the device, tensor by tensor, in the forms
the cuda forward reads: q|k|v and gate|up stacked into one matmul each, the
LM head restricted to the output vocabulary, and, at precision gguf, every
matmul weight the file stores in blocks kept as its blocks' integers and
scales (ir/quant.py), so the matmul computes with exactly the file's values.
The host holds one tensor at a time, never the model in float32.
"""
from __future__ import annotations

import torch

from hetero_sd.backends.cuda.ops import Blocks, Dense, stack
from hetero_sd.ir.config import ModelConfig
from hetero_sd.ir.families.decoder import down_name, gate_up_names, qkv_names
from hetero_sd.ir.model import ModelIR


def estimate_bytes(model: ModelIR, dtype_bytes: int, blocks: bool) -> int:
    """What the weights will take on the device: a GGUF kept in blocks about its
    file's size (codes widened to bytes for 5- and 6-bit types: at most twice), else
    every parameter at the compute type's width."""
    if blocks and model.fmt == "gguf":
        return 2 * model.source.stat().st_size
    cfg = model.config
    return parameter_count(cfg) * dtype_bytes


def parameter_count(cfg: ModelConfig) -> int:
    h, d = cfg.hidden_size, cfg.head_dim
    attn = h * d * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    per_layer = []
    for i in range(cfg.num_layers):
        if cfg.sparse(i):
            mlp = cfg.moe.num_experts * 3 * h * cfg.moe.intermediate_size + cfg.moe.num_experts * h
        else:
            mlp = 3 * h * cfg.intermediate_size
        per_layer.append(attn + mlp)
    heads = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    return sum(per_layer) + heads


def _is_matmul(cfg: ModelConfig, name: str) -> bool:
    return name.endswith("_proj.weight") or name.endswith("mlp.gate.weight") or name == "lm_head.weight"


def load_weights(model: ModelIR, dtype: torch.dtype, device: torch.device, blocks: bool,
                 progress=None) -> dict:
    """The forward's weights (forward.CudaForward reads these names)."""
    cfg, source = model.config, model.weights
    names = model.check_weights()
    raw: dict = {}
    for i, name in enumerate(names):
        if progress is not None:
            progress(i, len(names), name)
        raw[name] = _one(model, name, dtype, device, blocks and source.has_blocks)
        source.release_pages()
    return _assemble(cfg, raw, model, dtype, device, blocks and source.has_blocks)


def _one(model: ModelIR, name: str, dtype, device, blocks: bool):
    cfg = model.config
    if blocks and _is_matmul(cfg, name):
        quant = model.weights.blocks(name)
        if quant is not None:
            return Blocks.from_quant(quant, device)
    tensor = model.weights.get(name)
    if name.endswith(".bias") or "norm" in name:
        return tensor.to(device=device, dtype=dtype).contiguous()
    if _is_matmul(cfg, name):
        return Dense(tensor.to(device=device, dtype=dtype).contiguous())
    return tensor.to(device=device, dtype=dtype).contiguous()  # the embedding table


def _head(cfg: ModelConfig, raw: dict, model: ModelIR, dtype, device, blocks: bool):
    if cfg.tie_word_embeddings:
        quant = model.weights.blocks("model.embed_tokens.weight") if blocks else None
        head = Blocks.from_quant(quant, device) if quant is not None else Dense(raw["model.embed_tokens.weight"])
    else:
        head = raw.pop("lm_head.weight")
    n = cfg.output_vocab
    if n is None or n == cfg.vocab_size:
        return head
    if isinstance(head, Dense):
        return Dense(head.w[:n].contiguous())
    return Blocks(head.q[:n].contiguous(), head.scale[:n].contiguous(),
                  None if head.offset is None else head.offset[:n].contiguous(),
                  head.zero, head.group, head.bits, n, head.k, head.kind)


def _assemble(cfg: ModelConfig, raw: dict, model: ModelIR, dtype, device, blocks: bool) -> dict:
    out = {"embed": raw["model.embed_tokens.weight"], "norm": raw.pop("model.norm.weight"),
           "lm_head": _head(cfg, raw, model, dtype, device, blocks)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        parts = [raw.pop(n) for n in qkv_names(cfg, p)]
        if cfg.attention_bias:
            for part, c in zip(parts, "qkv"):
                part.bias = raw.pop(p + f"self_attn.{c}_proj.bias")
        out[p + "qkv"] = stack(parts)
        out[p + "self_attn.o_proj.weight"] = raw.pop(p + "self_attn.o_proj.weight")
        if cfg.sparse(i):
            out[p + "router"] = raw.pop(p + "mlp.gate.weight")
            for e in range(cfg.moe.num_experts):
                out[p + f"expert.{e}.gate_up"] = stack([raw.pop(n) for n in gate_up_names(p, cfg, e)])
                out[p + f"expert.{e}.down"] = raw.pop(down_name(p, e))
        else:
            out[p + "gate_up"] = stack([raw.pop(n) for n in gate_up_names(p, cfg)])
            out[p + "down"] = raw.pop(down_name(p))
    raw.pop("model.embed_tokens.weight")
    out.update(raw)  # the norms, under their IR names
    return out


def weight_bytes(weights: dict) -> int:
    total = 0
    for w in weights.values():
        for part in (w if isinstance(w, list) else [w]):
            total += part.nbytes() if isinstance(part, (Dense, Blocks)) else part.numel() * part.element_size()
    return total
