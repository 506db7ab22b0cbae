"""Attention for onnxruntime's CPU graph: com.microsoft GroupQueryAttention on
the sequence's own slab, read and written in place.

The runner binds each layer's slab views [1, Hkv, R, D] as both `past_k_i` /
`past_v_i` and the outputs `present_k_i` / `present_v_i` (onnxruntime's I/O
binding; the op sees one buffer and writes only the new rows into it), so a
step copies no window: attention reads the live slots where they lie, RoPE
runs inside the op, and a layer is a dozen nodes, not sixty.

Rows and rounding (measured on onnxruntime 1.32, the tests prove it bitwise):
a row of a call of S >= 2 rows rounds the same whatever S and wherever it sits,
but S = 1 takes MLAS's one-row GEMM kernel, which rounds apart. So attention
always runs on at least two rows: a one-token call repeats its token's q/k/v
as a second row (`att_rows` = [0, 0]); that row lands one slot past the
sequence's length, a slot the runner keeps spare and the next call overwrites.
The linear layers still run on the one real row.

Extra inputs (onnx_llama.py holds the rest of the contract):
  att_rows    int64 [S]   row of the layer's q/k/v for each attention row:
                          0..T-1, or [0, 0] for one token
  seqlens_k   int32 [1]   past_len + S - 1 (the op's "total length minus one")
  total_len   int32 []    past_len + S
and outputs present_k_i / present_v_i [1, Hkv, R, D], bound to the slab.
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from hetero_sd.backends.onnx_blocks import last_rows, rms_norm, rope, split


def native_rope(cfg) -> bool:
    """Whether the op applies the model's RoPE itself: it takes half-widths that are
    multiples of 8 (onnxruntime 1.32); else the graph ropes q and k before it."""
    return cfg.rope_dim // 2 % 8 == 0


def _rope_caches(b, cfg, half: bool | None = None) -> dict:
    """cos and sin per RoPE kind (local or not), one row per position and one
    more, where the repeated row of a one-token call at the last position sits:
    [positions + 1, rope_dim / 2] for the op, or [.., rope_dim] for our own
    RoPE nodes (onnx_blocks.rope); `half` forces the op's (None: as native_rope)."""
    import torch

    from hetero_sd.ir.families.decoder import rope_cos_sin

    width = cfg.rope_dim // 2 if (native_rope(cfg) if half is None else half) else cfg.rope_dim
    positions = torch.arange(cfg.max_position_embeddings + 1)
    caches = {}
    for local in {cfg.local_rope(i) for i in range(cfg.num_layers)}:
        cos, sin = (np.ascontiguousarray(t.numpy()[:, :width], dtype=np.float32)
                    for t in rope_cos_sin(cfg, positions, local))
        caches[local] = (b.const(cos, "cos"), b.const(sin, "sin"))
    return caches


def _own_rope(b, cfg, x: str, heads: int, cos: str, sin: str, positions: str) -> str:
    """x [1, S, heads * D] roped by our nodes at `positions` [S]."""
    i64 = lambda *v: b.const(list(v), dtype=np.int64)  # noqa: E731
    D = cfg.head_dim
    tables = [b.op("Reshape", b.op("Gather", t, positions, axis=0), i64(1, 1, -1, cfg.rope_dim)) for t in (cos, sin)]
    x = b.op("Transpose", b.op("Reshape", x, i64(1, -1, heads, D)), perm=[0, 2, 1, 3])  # [1, heads, S, D]
    x = rope(b, x, *tables, cfg.rope_dim, D)
    return b.op("Reshape", b.op("Transpose", x, perm=[0, 2, 1, 3]), i64(1, -1, heads * D))


def _gqa(b, cfg, caches: dict, i: int, rows: str, norms: tuple, positions: str | None) -> str:
    """GroupQueryAttention over the attention rows [1, S, (H + 2 Hkv) D] (S >= 2)
    at `positions` [S] (given where the graph ropes), the layer's slab as past and
    present -> [S, H*D]."""
    H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    i64 = lambda *v: b.const(list(v), dtype=np.int64)  # noqa: E731
    q_norm, k_norm = norms
    roped, native = cfg.uses_rope(i), native_rope(cfg)
    op_ropes = roped and native
    cos, sin = caches[cfg.local_rope(i)] if roped else ("", "")
    if q_norm is not None or (roped and not native):
        q, k, v = split(b, rows, [H * D, Hkv * D, Hkv * D])
        if q_norm is not None:  # per-head norms come before RoPE
            q, k = (b.op("Reshape", rms_norm(b, b.op("Reshape", t, i64(1, -1, n, D)), w, cfg.rms_norm_eps),
                         i64(1, -1, n * D)) for t, n, w in ((q, H, q_norm), (k, Hkv, k_norm)))
        if roped and not native:
            q, k = (_own_rope(b, cfg, t, n, cos, sin, positions) for t, n in ((q, H), (k, Hkv)))
        qkv_in = [q, k, v]
    else:
        qkv_in = [rows, "", ""]  # packed q/k/v: the op splits it
    if not op_ropes:
        cos = sin = ""
    attrs = {"num_heads": H, "kv_num_heads": Hkv, "scale": float(cfg.attention_scale),
             "do_rotary": int(op_ropes), "rotary_interleaved": 0}
    if cfg.window(i) is not None:
        attrs["local_window_size"] = cfg.window(i)  # keys in all, the query's own among them (1.32; the family tests check it)
    if cfg.attn_softcap is not None:
        attrs["softcap"] = float(cfg.attn_softcap)
    out = b.name("gqa")
    b.nodes.append(helper.make_node("GroupQueryAttention",
                                    qkv_in + [f"past_k_{i}", f"past_v_{i}", "seqlens_k", "total_len", cos, sin],
                                    [out, f"present_k_{i}", f"present_v_{i}"], name=out, domain="com.microsoft",
                                    **attrs))
    return b.op("Reshape", out, i64(-1, H * D))


class InPlaceAttention:
    """One sequence, its slab bound in place (the module docstring)."""

    takes_qkv = True  # attend_qkv(): RoPE, norms and attention from the fused q/k/v rows
    domains: tuple[str, ...] = ()  # custom-op domains the graph imports (onnx_native.py)

    def __init__(self, b, cfg):
        self.b, self.cfg = b, cfg
        self.T = b.op("Shape", "input_ids")
        self.caches = _rope_caches(b, cfg)
        self.positions = None  # the attention rows' positions, past_len .. past_len + S - 1: for our own RoPE
        if not native_rope(cfg):
            total = b.op("Cast", "total_len", to=TensorProto.INT64)
            self.positions = b.op("Range", b.op("Sub", total, b.op("Squeeze", b.op("Shape", "att_rows"))), total,
                                  b.const(np.int64(1)))

    def _i64(self, *v):
        return self.b.const(list(v), dtype=np.int64)

    def attend_qkv(self, i: int, qkv: str, q_norm: np.ndarray | None, k_norm: np.ndarray | None) -> str:
        """The layer's fused q/k/v rows [T, (H + 2 Hkv) D] -> attention output [T, H*D]."""
        b, i64 = self.b, self._i64
        rows = b.op("Unsqueeze", b.op("Gather", qkv, "att_rows", axis=0), i64(0))  # [1, S, (H+2Hkv) D]
        att = _gqa(b, self.cfg, self.caches, i, rows, (q_norm, k_norm), self.positions)
        return b.op("Slice", att, i64(0), b.op("Reshape", b.op("Squeeze", self.T), i64(1)), i64(0))

    def logit_rows(self, x: str) -> str:
        return last_rows(self.b, x, self.T, "num_logits")

    def _slab(self, name: str):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, self.cfg.num_kv_heads, "R", self.cfg.head_dim])

    def inputs(self) -> list:
        v = helper.make_tensor_value_info
        out = [v("input_ids", TensorProto.INT64, ["T"]), v("att_rows", TensorProto.INT64, ["S"]),
               v("seqlens_k", TensorProto.INT32, [1]), v("total_len", TensorProto.INT32, []),
               v("num_logits", TensorProto.INT64, [])]
        for i in range(self.cfg.num_layers):
            out += [self._slab(f"past_k_{i}"), self._slab(f"past_v_{i}")]
        return out

    def outputs(self) -> list:
        return [self._slab(f"present_{n}_{i}") for i in range(self.cfg.num_layers) for n in "kv"]
