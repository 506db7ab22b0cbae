"""Attention for a batched forward: several sequences' rows in one graph call.

The graph's linear layers run on every sequence's rows packed together (the
weights are read once per call, which is where a batch earns its throughput).
Attention stays per sequence: each reads only its own keys, gathered from the
backend's whole KV pool (bound as one input, never copied outside the graph)
by an index the runner computes from the sequences' extents.

Extra inputs (onnx_llama.py holds the rest of the contract):
  positions   int64 [T]           absolute position of each packed row
  pool        float [P, D]        the pool's memory as rows of head_dim floats
  kv_index    int64 [B, Hkv, W]   pool row of (seq b, kv head h, slot w) for layer 0's
                                  keys: base_b + h*R_b + min(w, R_b - 1), where the
                                  sequence's slab [2, layers, Hkv, R_b, D] starts at row base_b
  kv_stride   int64 [B, 1, 1]     Hkv*R_b: rows from one (k|v, layer) block to the next
  pad_rows    int64 [B*Tmax]      packed row for each padded slot (padding repeats a
                                  sequence's last row: same position, same values, so
                                  the scatter of new keys stays deterministic)
  q_pos_pad   int64 [B, Tmax]     positions in the padded layout
  unpad_rows  int64 [T]           padded slot of each packed row
  logit_rows  int64 [N]           packed rows whose logits are returned
Each row reduces over its own window in the same order as in a one-sequence
call (masked slots add exact zeros; onnxruntime's rows are window-invariant),
so a row rounds alike alone or in any batch: the tests prove it bitwise.
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from hetero_sd.backends.onnx_blocks import softcap

class PoolAttention:
    takes_qkv = False  # attend() takes roped q and the new k/v
    domains: tuple[str, ...] = ()  # custom-op domains the graph imports (onnx_native.py)

    def __init__(self, b, cfg):
        self.b, self.cfg = b, cfg
        i64 = self._i64
        Hkv, D, G = cfg.num_kv_heads, cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
        self.q_pos = "positions"
        W = b.op("Shape", "kv_index", start=2, end=3)
        k_idx = b.op("Range", b.const(np.int64(0)), b.op("Squeeze", W), b.const(np.int64(1)))
        q = b.op("Unsqueeze", "q_pos_pad", i64(2))  # [B, Tmax, 1]
        k = b.op("Reshape", k_idx, i64(1, 1, -1))  # [1, 1, W]
        causal = b.op("LessOrEqual", k, q)  # [B, Tmax, W]
        self.masks = {}  # window -> [B, 1, G*Tmax, W]: the rows of q's kv-head groups are g-major, then t
        for window in cfg.windows:
            visible = causal if window is None else b.op(
                "And", causal, b.op("Less", b.op("Sub", q, k), b.const(np.int64(window))))
            expanded = b.op("Expand", b.op("Unsqueeze", visible, i64(1)), i64(1, G, 1, 1))
            self.masks[window] = b.op("Reshape", expanded, i64(0, 1, -1, 0))
        self.slots = b.op("Expand", b.op("Unsqueeze", b.op("Unsqueeze", "q_pos_pad", i64(1)), i64(3)),
                          i64(1, Hkv, 1, D))  # [B, Hkv, Tmax, D]
        self.minus_inf = b.const(np.float32(-np.inf))

    def _i64(self, *v):
        return self.b.const(list(v), dtype=np.int64)

    def _window(self, which: int, new: str) -> str:
        """The sequences' windows of block `which` ((k|v) * layers + layer) with
        the new rows in place: [B, Hkv, W, D]."""
        b = self.b
        idx = b.op("Add", "kv_index", b.op("Mul", "kv_stride", b.const(np.int64(which))))
        window = b.op("Gather", "pool", idx, axis=0)
        padded = self._by_sequence(b.op("Gather", new, "pad_rows", axis=2))  # [B, Hkv, Tmax, D]
        return b.op("ScatterElements", window, self.slots, padded, axis=2)

    def _by_sequence(self, x: str) -> str:
        """[1, heads, B*Tmax, D] -> [B, heads, Tmax, D]."""
        b, i64 = self.b, self._i64
        tmax = b.op("Shape", "q_pos_pad", start=1, end=2)
        heads = b.op("Shape", x, start=1, end=2)
        shape = b.op("Concat", heads, i64(-1), tmax, i64(self.cfg.head_dim), axis=0)
        return b.op("Transpose", b.op("Reshape", x, shape), perm=[1, 0, 2, 3])

    def attend(self, i: int, q: str, k_new: str, v_new: str) -> str:
        """q [1, H, T, D] (roped, scaled), the layer's new k/v [1, Hkv, T, D] -> [T, H*D]."""
        b, cfg, i64 = self.b, self.cfg, self._i64
        H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        G, L = H // Hkv, cfg.num_layers
        k_all, v_all = self._window(i, k_new), self._window(L + i, v_new)
        # q grouped by kv head: [B, Hkv, G*Tmax, D]
        qb = self._by_sequence(b.op("Gather", q, "pad_rows", axis=2))  # [B, H, Tmax, D]
        qb = b.op("Reshape", qb, i64(0, Hkv, -1, D))
        scores = softcap(b, b.op("MatMul", qb, b.op("Transpose", k_all, perm=[0, 1, 3, 2])), cfg.attn_softcap)
        probs = b.op("Softmax", b.op("Where", self.masks[cfg.window(i)], scores, self.minus_inf), axis=-1)
        att = b.op("Reshape", b.op("MatMul", probs, v_all), i64(0, H, -1, D))  # [B, H, Tmax, D]
        att = b.op("Reshape", b.op("Transpose", att, perm=[0, 2, 1, 3]), i64(-1, H * D))  # [B*Tmax, H*D]
        return b.op("Gather", att, "unpad_rows", axis=0)

    def logit_rows(self, x: str) -> str:
        return self.b.op("Gather", x, "logit_rows", axis=0)

    def inputs(self) -> list:
        i64, f = TensorProto.INT64, TensorProto.FLOAT
        v = helper.make_tensor_value_info
        return [v("input_ids", i64, ["T"]), v("positions", i64, ["T"]),
                v("pool", f, ["P", self.cfg.head_dim]), v("kv_index", i64, ["B", self.cfg.num_kv_heads, "W"]),
                v("kv_stride", i64, ["B", 1, 1]), v("pad_rows", i64, ["BT"]), v("q_pos_pad", i64, ["B", "Tmax"]),
                v("unpad_rows", i64, ["T"]), v("logit_rows", i64, ["N"])]
