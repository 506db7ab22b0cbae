"""Attention for onnxruntime's CPU graph by our own op (backends/native):
SlabAttention over the backend's whole KV pool, several sequences a call
(varlen), each row one query at a time.

The pool is bound once as an input (the runner's own memory, ort_varlen.py); the
op reads every sequence's slab where it lies and writes the new rows' K and V
into it, so the graph has no KV output. Every (row, head) runs the same loop over
its own sequence's positions whatever else the call holds, so a row rounds alike
in a one-token call, inside a k-row verify and inside a server's batch of any
size and mix: one graph serves every caller. RoPE (rotate-half) runs inside the
op from half-width tables; per-head q/k norms run in the graph before it.

Inputs (onnx_llama.py holds the rest of the contract):
  input_ids   int64 [T]     every sequence's rows, packed in order
  pool        float [N]     the pool's memory, written in place
  seqs        int64 [B, 5]  per sequence: first row, rows, past length, reserved
                            positions R, float offset of its slab [2, layers, Hkv, R, D]
  logit_rows  int64 [n]     packed rows whose logits are returned

Only models the op covers take it (`native_fits` in backends/native: a head
dimension that is a multiple of 16 up to 512, at most 64 query heads a KV head);
others, and hosts where it cannot be built, run the pool-gathering graph
(onnx_batch.py) for every call.
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from hetero_sd.backends.native import DOMAIN, native_fits
from hetero_sd.backends.onnx_blocks import rms_norm, split

SEQ_FIELDS = ("row", "rows", "past", "reserved", "offset")  # a row of the seqs input


class NativeAttention:
    """Several sequences, the pool bound in place, attention by SlabAttention."""

    takes_qkv = True  # attend_qkv(): RoPE, norms and attention from the fused q/k/v rows
    domains = (DOMAIN,)

    def __init__(self, b, cfg):
        ok, why = native_fits(cfg)
        if not ok:
            raise ValueError(f"SlabAttention does not cover this model: {why}")
        self.b, self.cfg = b, cfg
        self.caches = _rope_caches(b, cfg)  # [positions + 1, rope_dim / 2]
        self._empty: str | None = None  # the no-RoPE cache, added to the graph on first use only

    def _i64(self, *v):
        return self.b.const(list(v), dtype=np.int64)

    def attend_qkv(self, i: int, qkv: str, q_norm: np.ndarray | None, k_norm: np.ndarray | None) -> str:
        """The layer's fused q/k/v rows [T, (H + 2 Hkv) D] -> attention output [T, H*D]."""
        cfg, b = self.cfg, self.b
        if q_norm is not None:  # per-head norms come before RoPE, row by row
            H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
            q, k, v = split(b, qkv, [H * D, Hkv * D, Hkv * D])
            q, k = (b.op("Reshape", rms_norm(b, b.op("Reshape", t, self._i64(-1, n, D)), w, cfg.rms_norm_eps),
                         self._i64(-1, n * D)) for t, n, w in ((q, H, q_norm), (k, Hkv, k_norm)))
            qkv = b.op("Concat", q, k, v, axis=1)
        roped = cfg.uses_rope(i)
        cos, sin = self.caches[cfg.local_rope(i)] if roped else self._no_rope()
        out = b.name("slab_attention")
        b.nodes.append(helper.make_node(
            "SlabAttention", [qkv, "pool", "seqs", cos, sin], [out], name=out, domain=DOMAIN,
            num_heads=cfg.num_heads, kv_num_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, layer=i,
            num_layers=cfg.num_layers, rotary=int(roped), scale=float(cfg.attention_scale),
            window=int(cfg.window(i) or 0), softcap=float(cfg.attn_softcap or 0.0)))
        return out

    def _no_rope(self):
        if self._empty is None:
            self._empty = self.b.const(np.zeros((1, self.cfg.head_dim // 2), np.float32), "norope")
        return self._empty, self._empty

    def logit_rows(self, x: str) -> str:
        return self.b.op("Gather", x, "logit_rows", axis=0)

    def inputs(self) -> list:
        v = helper.make_tensor_value_info
        return [v("input_ids", TensorProto.INT64, ["T"]), v("pool", TensorProto.FLOAT, ["N"]),
                v("seqs", TensorProto.INT64, ["B", len(SEQ_FIELDS)]), v("logit_rows", TensorProto.INT64, ["L"])]

    def outputs(self) -> list:
        return []  # the op writes the new K/V into the pool itself


def _rope_caches(b, cfg) -> dict:
    """cos and sin per RoPE kind (local or not), one row per position and one more
    (where a padded call's extra row sits): [positions + 1, rope_dim / 2]."""
    import torch

    from hetero_sd.ir.families.decoder import rope_cos_sin

    positions = torch.arange(cfg.max_position_embeddings + 1)
    caches = {}
    for local in {cfg.local_rope(i) for i in range(cfg.num_layers)}:
        cos, sin = (np.ascontiguousarray(t.numpy()[:, :cfg.rope_dim // 2], dtype=np.float32)
                    for t in rope_cos_sin(cfg, positions, local))
        caches[local] = (b.const(cos, "cos"), b.const(sin, "sin"))
    return caches
