"""The cuda backend's forward: the IR's reference forward (ir/families/forward.py)
computed by the Triton kernels of kernels.py, for every family the IR knows.

One call runs the rows of one or several sequences (a decode, a verify, a
prefill, a server batch: the same kernels and tiles for all), each row at its
own position against its own sequence's slots of the KV pool. What a family
adds (q/k norms, Gemma's four norms and softcaps, windows and local RoPE,
NoPE layers, partial rotary, fused projections, experts) is read from the
ModelConfig, as the reference does.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hetero_sd.backends.cuda.ops import Kernels
from hetero_sd.ir.config import ModelConfig
from hetero_sd.ir.families.decoder import rope_cos_sin


@dataclass
class Rows:
    """One call's rows, on the device. Sequence s's rows are contiguous; row r sits at
    position pos[r] of a sequence whose position 0 is pool slot base[r]."""
    ids: torch.Tensor  # int64 [T]
    pos: torch.Tensor  # int32 [T]
    base: torch.Tensor  # int32 [T]
    slots: torch.Tensor  # int64 [T]: base + pos, where each row's K and V are written
    logit_rows: torch.Tensor  # int64 [R]: the rows whose logits are returned, in order
    splits: int  # KV splits the longest row needs (kernels.Kernels.attention)
    counts: tuple[int, ...]  # rows per sequence


def rope_tables(cfg: ModelConfig, positions: int, device: torch.device) -> dict[bool, tuple]:
    """float32 cos / sin [positions, rope_dim] for the global and (Gemma 3) local bases:
    the reference's own values (rope_cos_sin), looked up by position in the kernel."""
    out = {}
    for local in {cfg.local_rope(i) for i in range(cfg.num_layers)}:
        cos, sin = rope_cos_sin(cfg, torch.arange(positions), local)
        out[local] = (cos.contiguous().to(device), sin.contiguous().to(device))
    return out


class CudaForward:
    def __init__(self, cfg: ModelConfig, weights: dict, kernels: Kernels, k_pool: torch.Tensor,
                 v_pool: torch.Tensor, ropes: dict):
        self.cfg, self.w, self.ops = cfg, weights, kernels
        self.k_pool, self.v_pool, self.ropes = k_pool, v_pool, ropes

    def __call__(self, rows: Rows, features: list | None = None) -> torch.Tensor:
        """float32 logits [R, logits_vocab] of rows.logit_rows; with `features` (a list)
        and cfg.feature_layers, one float32 [n, layers * hidden] per sequence is appended."""
        cfg, ops = self.cfg, self.ops
        x = self.w["embed"][rows.ids]
        if cfg.embed_scale is not None:
            x = x * torch.tensor(cfg.embed_scale, dtype=x.dtype)
        wanted = cfg.feature_layers if features is not None else ()
        captured = {}
        for i in range(cfg.num_layers):
            x = self._layer(i, x, rows)
            if i in wanted:
                captured[i] = x
        if wanted:
            feats = torch.cat([captured[i] for i in wanted], dim=-1).float()
            features.extend(feats.split(list(rows.counts)))
        h = ops.rms_norm(x[rows.logit_rows].contiguous(), self.w["norm"], cfg.rms_norm_eps)
        logits = ops.linear(h, self.w["lm_head"], torch.float32)
        if cfg.final_softcap is not None:
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return logits

    def _layer(self, i: int, x: torch.Tensor, rows: Rows) -> torch.Tensor:
        cfg, ops, w, p = self.cfg, self.ops, self.w, f"model.layers.{i}."
        n, D, eps = x.shape[0], cfg.head_dim, cfg.rms_norm_eps
        h = ops.rms_norm(x, w[p + "input_layernorm.weight"], eps)
        qkv = ops.linear(h, w[p + "qkv"])
        q, k, v = qkv.split([cfg.num_heads * D, cfg.num_kv_heads * D, cfg.num_kv_heads * D], dim=-1)
        q = q.reshape(n, cfg.num_heads, D).contiguous()
        k = k.reshape(n, cfg.num_kv_heads, D).contiguous()
        v = v.reshape(n, cfg.num_kv_heads, D)
        if cfg.qk_norm:
            q = ops.rms_norm(q, w[p + "self_attn.q_norm.weight"], eps)
            k = ops.rms_norm(k, w[p + "self_attn.k_norm.weight"], eps)
        if cfg.uses_rope(i):
            cos, sin = self.ropes[cfg.local_rope(i)]
            ops.rope_(q, cos, sin, rows.pos)
            ops.rope_(k, cos, sin, rows.pos)
        self.k_pool[i][:, rows.slots] = k.transpose(0, 1)
        self.v_pool[i][:, rows.slots] = v.transpose(0, 1)
        att = ops.attention(q, self.k_pool[i], self.v_pool[i], rows.pos, rows.base, cfg.window(i),
                            cfg.attention_scale, cfg.attn_softcap, rows.splits)
        out = ops.linear(att.reshape(n, -1), w[p + "self_attn.o_proj.weight"])
        if cfg.sandwich_norms:
            x = x + ops.rms_norm(out, w[p + "post_attention_layernorm.weight"], eps)
            h = ops.rms_norm(x, w[p + "pre_feedforward_layernorm.weight"], eps)
        else:
            x = x + out
            h = ops.rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        out = self._moe(h, p) if cfg.sparse(i) else self._mlp(h, p)
        if cfg.sandwich_norms:
            out = ops.rms_norm(out, w[p + "post_feedforward_layernorm.weight"], eps)
        return x + out

    def _mlp(self, h: torch.Tensor, p: str, expert: str = "") -> torch.Tensor:
        a = self.ops.gated(self.ops.linear(h, self.w[p + expert + "gate_up"]), self.cfg.hidden_act)
        return self.ops.linear(a, self.w[p + expert + "down"])

    def _moe(self, h: torch.Tensor, p: str) -> torch.Tensor:
        """Each row's chosen experts, summed in expert-index order from zero, as the
        reference does; each expert runs on the rows that chose it (a gathered row
        rounds as it does alone: every kernel is row-invariant). The set of experts
        is read back to the host, so an MoE layer is not graph-captured."""
        moe = self.cfg.moe
        idx, weight = self.ops.router(self.ops.linear(h, self.w[p + "router"], torch.float32),
                                      moe.experts_per_token, moe.normalize_topk)
        weight = weight.to(h.dtype)
        out = torch.zeros_like(h)
        for e in torch.unique(idx).tolist():
            rows, slot = torch.where(idx == e)
            y = self._mlp(h[rows].contiguous(), p, f"expert.{e}.")
            out.index_add_(0, rows, y * weight[rows, slot, None])
        return out
