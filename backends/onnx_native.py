"""Attention for onnxruntime's CPU graph by our own op (backends/native):
SlabAttention on the sequence's slab, in place, one query row at a time.

The same contract as the in-place GroupQueryAttention graph (onnx_gqa.py: the
slab views bound as past and present, only the new rows written), less its
two-row minimum: every (row, head) runs the same loop whatever the call's width,
so a one-token call is one row everywhere and the inputs `att_rows` and
`seqlens_k` are gone. RoPE (rotate-half) runs inside the op from half-width
tables, as GroupQueryAttention's did.

Only models the op covers take it (`native_fits` in backends/native: no per-head
q/k norms, sliding windows or score soft-capping, a head dimension that is a
multiple of 16 up to 512, at most 64 query heads a KV head); others keep
GroupQueryAttention.
"""
from __future__ import annotations

import numpy as np

from hetero_sd.backends.native import DOMAIN, native_fits
from hetero_sd.backends.onnx_gqa import InPlaceAttention, _rope_caches


class NativeAttention(InPlaceAttention):
    """One sequence, its slab bound in place, attention by SlabAttention."""

    domains = (DOMAIN,)

    def __init__(self, b, cfg):
        ok, why = native_fits(cfg)
        if not ok:
            raise ValueError(f"SlabAttention does not cover this model: {why}")
        self.b, self.cfg = b, cfg
        self.T = b.op("Shape", "input_ids")
        self.caches = _rope_caches(b, cfg, half=True)  # [positions + 1, rope_dim / 2]
        self.positions = None

    def attend_qkv(self, i: int, qkv: str, q_norm, k_norm) -> str:
        cfg, b = self.cfg, self.b
        roped = cfg.uses_rope(i)
        cos, sin = self.caches[cfg.local_rope(i)] if roped else self._no_rope()
        out = b.name("slab_attention")
        b.nodes.append(_node(out, qkv, i, cos, sin, cfg, roped))
        return out

    def _no_rope(self):
        if not hasattr(self, "_empty"):
            self._empty = self.b.const(np.zeros((1, self.cfg.head_dim // 2), np.float32), "norope")
        return self._empty, self._empty

    def inputs(self) -> list:
        return [v for v in super().inputs() if v.name not in ("att_rows", "seqlens_k")]


def _node(out: str, qkv: str, i: int, cos: str, sin: str, cfg, roped: bool):
    from onnx import helper

    return helper.make_node("SlabAttention", [qkv, f"past_k_{i}", f"past_v_{i}", "total_len", cos, sin],
                            [out, f"present_k_{i}", f"present_v_{i}"], name=out, domain=DOMAIN,
                            num_heads=cfg.num_heads, kv_num_heads=cfg.num_kv_heads, rotary=int(roped),
                            scale=float(cfg.attention_scale))
