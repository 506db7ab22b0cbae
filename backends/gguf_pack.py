"""How our GGUFMatMul (backends/native/gguf_matmul.c) holds a GGUF file's K-quant
weights: the file's super-blocks, 8 columns interleaved.

Within a group of 8 output columns and one super-block of 256 values, every field
is laid out column-minor, so that one 32-byte load holds 4 consecutive values of
each of the 8 columns (one int32 lane a column) and each field of 8 columns loads
as one vector:

  Q4_K (1184 bytes, 148 a column against the file's 144: its 12 bytes of packed
  6-bit scales and minimums unpacked to one byte each)
    d[8] fp16 | dmin[8] fp16 | scales[8 sub-blocks][8] | mins[8][8]
    | qs[4 chunks of 64 values][8 steps][8 columns][4 bytes]
      (a byte's low nibble is value 64c + 4s + i, its high one 64c + 32 + 4s + i)

  Q6_K (1696 bytes, 212 a column against the file's 210: padded to a multiple
  of 32, so that no 32-byte load of the op straddles two cache lines)
    [2 halves][8 steps]( ql[0][8 columns][4 bytes] | ql[1][8][4] | qh[8][4] )
    | d[8] fp16 | scales[16 sub-blocks][8] int8 | 16 zero bytes
      (a step's three rows together: a one-row call reads the weights in address
      order, which the hardware prefetcher follows)

A last group short of 8 columns is padded with zero blocks (d = 0), whose outputs
the op drops. Every number is the file's: the op computes with exactly its weights.
"""
from __future__ import annotations

import numpy as np

from hetero_sd.ir import quant

GROUP = 8  # columns a group
BYTES = {"Q4_K": 1184, "Q6_K": 1696}  # a group's super-block
FILE_BYTES = {"Q4_K": 144, "Q6_K": 210}  # a column's super-block in the file


def pack(kind: str, raw: np.ndarray) -> np.ndarray:
    """The file's bytes [N, K / 256 * bytes] -> [ceil(N / 8), K / 256, BYTES[kind]] uint8."""
    if kind not in BYTES:
        raise ValueError(f"GGUFMatMul holds {', '.join(BYTES)}, not {kind}")
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(n, -1, FILE_BYTES[kind])
    pad = -n % GROUP
    if pad:
        blocks = np.concatenate([blocks, np.zeros((pad, *blocks.shape[1:]), np.uint8)])
    groups, nsb = blocks.shape[0] // GROUP, blocks.shape[1]
    b = blocks.reshape(groups, GROUP, nsb, FILE_BYTES[kind])

    def minor(field: np.ndarray) -> np.ndarray:
        """[groups, 8 columns, nsb, *rest, unit] -> [groups, nsb, *rest, 8 columns, unit], flat."""
        moved = np.moveaxis(field, 1, -2)
        return moved.reshape(groups, nsb, -1)

    if kind == "Q4_K":
        sc, mn = quant.k_scales(b[..., 4:16].reshape(-1, 12))
        sc = sc.astype(np.uint8).reshape(groups, GROUP, nsb, 8, 1)
        mn = mn.astype(np.uint8).reshape(groups, GROUP, nsb, 8, 1)
        parts = [b[..., 0:2], b[..., 2:4], sc, mn, b[..., 16:].reshape(groups, GROUP, nsb, 4, 8, 4)]
    else:
        ql = b[..., 0:128].reshape(groups, GROUP, nsb, 2, 2, 8, 4).swapaxes(4, 5)  # [half][step][j][4]
        qh = b[..., 128:192].reshape(groups, GROUP, nsb, 2, 8, 1, 4)
        parts = [np.concatenate([ql, qh], axis=5),  # a step's two ql rows and its qh row together
                 b[..., 208:210], b[..., 192:208].reshape(groups, GROUP, nsb, 16, 1),
                 np.zeros((groups, GROUP, nsb, 2), np.uint8)]
    out = np.concatenate([minor(p) for p in parts], axis=-1)
    assert out.shape[-1] == BYTES[kind]
    return out


def pack_gated(kind: str, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """An MLP's gate and up projections (the file's bytes, alike in shape) for GGUFMatMul's
    gated form: each group of 8 gate columns followed by the up group of the same
    columns, [2 ceil(N / 8), K / 256, BYTES[kind]], so one task of the op holds both
    halves of its output columns (Y = silu(gate) * up, no [.., 2N] tensor between)."""
    g, u = pack(kind, gate), pack(kind, up)
    if g.shape != u.shape:
        raise ValueError(f"gate and up differ in shape: {g.shape} against {u.shape}")
    return np.stack([g, u], axis=1).reshape(-1, *g.shape[1:])
