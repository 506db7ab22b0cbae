"""How our GGUFMatMul (backends/native/gguf_matmul.c) holds a GGUF file's K-quant
weights: the file's super-blocks, 8 columns interleaved.

Within a group of 8 output columns and one super-block of 256 values, every field
is laid out column-minor, so that one 32-byte load holds 4 consecutive values of
each of the 8 columns (one int32 lane a column) and each field of 8 columns loads
as one vector:

  Q4_K (1184 bytes, 148 a column against the file's 144: its 12 bytes of packed
  6-bit scales and minimums unpacked to one byte each)
    d[8] fp16 | dmin[8] fp16 | scales[8 sub-blocks][8] | mins[8][8]
    | qs[4 chunks of 64 values][4 step pairs][8 columns][2 steps][4 bytes]
      (a byte's low nibble is value 64c + 4s + i, its high one 64c + 32 + 4s + i;
      a column's two steps together, so that a 512-bit load is a step pair of 8
      columns, a 64-bit lane a column's, fed by one 64-bit activation broadcast;
      for the AVX2 build, pairs=False: [2 steps][8 columns][4 bytes] a pair)

  Q6_K (1696 bytes, 212 a column against the file's 210: padded to a multiple
  of 32, so that no 32-byte load of the op straddles two cache lines)
    [2 halves][4 step pairs]( ql[0][8 columns][2 steps][4 bytes] | ql[1][8][2][4]
    | qh[8][2][4] ) | d[8] fp16 | scales[16 sub-blocks][8] int8 | 16 zero bytes
      (pairs=False: [2 steps][8 columns][4] within each of ql[0], ql[1], qh)
      (a pair's three rows together: a one-row call reads the weights in address
      order, which the hardware prefetcher follows; step pairs as Q4_K's)

A last group short of 8 columns is padded with zero blocks (d = 0), whose outputs
the op drops. Every number is the file's: the op computes with exactly its weights.
"""
from __future__ import annotations

import numpy as np

from hetero_sd.ir import quant

GROUP = 8  # columns a group
# a group's unit along K: a super-block of 256 values (K-quants), or two blocks of 32
BYTES = {"Q4_K": 1184, "Q6_K": 1696, "Q4_0": 288, "Q4_1": 320, "Q5_0": 352, "Q5_1": 384, "Q8_0": 544}
UNIT = {kind: 256 if kind.endswith("_K") else 64 for kind in BYTES}  # values a unit
FILE_BYTES = {"Q4_K": 144, "Q6_K": 210, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}  # a file block


def pack(kind: str, raw: np.ndarray, *, pairs: bool) -> np.ndarray:
    """The file's bytes [N, K / block * bytes] -> [ceil(N / 8), K / UNIT[kind], BYTES[kind]] uint8;
    pairs: the step pairs as the AVX-512 build reads them (a column's two steps
    together), else as the AVX2 build does (a step's 8 columns, then the next's):
    native.gguf_pairs() says which the library built here reads."""
    if kind not in BYTES:
        raise ValueError(f"GGUFMatMul holds {', '.join(BYTES)}, not {kind}")
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(n, -1, FILE_BYTES[kind])
    pad = -n % GROUP
    if pad:
        blocks = np.concatenate([blocks, np.zeros((pad, *blocks.shape[1:]), np.uint8)])
    groups = blocks.shape[0] // GROUP
    if UNIT[kind] == 64:
        if blocks.shape[1] % 2:
            raise ValueError(f"{kind}: a row of {blocks.shape[1] * 32} values is not a multiple of 64")
        return _pack_blocks32(kind, blocks.reshape(groups, GROUP, -1, 2, FILE_BYTES[kind]), pairs)
    nsb = blocks.shape[1]
    b = blocks.reshape(groups, GROUP, nsb, FILE_BYTES[kind])
    minor = lambda field: _minor(field, groups, nsb)  # noqa: E731

    if kind == "Q4_K":
        sc, mn = quant.k_scales(b[..., 4:16].reshape(-1, 12))
        sc = sc.astype(np.uint8).reshape(groups, GROUP, nsb, 8, 1)
        mn = mn.astype(np.uint8).reshape(groups, GROUP, nsb, 8, 1)
        parts = [b[..., 0:2], b[..., 2:4], sc, mn, _steps(b[..., 16:].reshape(groups, GROUP, nsb, 4, 4, 8), pairs)]
    else:
        ql = b[..., 0:128].reshape(groups, GROUP, nsb, 2, 2, 4, 8).swapaxes(4, 5)  # [half][pair][j][2 steps x 4]
        qh = b[..., 128:192].reshape(groups, GROUP, nsb, 2, 4, 1, 8)
        parts = [_steps(np.concatenate([ql, qh], axis=5), pairs),  # a pair's two ql rows and its qh row together
                 b[..., 208:210], b[..., 192:208].reshape(groups, GROUP, nsb, 16, 1),
                 np.zeros((groups, GROUP, nsb, 2), np.uint8)]
    out = np.concatenate([minor(p) for p in parts], axis=-1)
    assert out.shape[-1] == BYTES[kind]
    return out


def _steps(field: np.ndarray, pairs: bool) -> np.ndarray:
    """[groups, 8 columns, .., 8 bytes: a column's two steps] as the op reads them: so
    (pairs, after _minor: [8 columns][2 steps][4]), or each step a field of its own
    (after _minor: [2 steps][8 columns][4])."""
    return field if pairs else field.reshape(*field.shape[:-1], 2, 4)


def _minor(field: np.ndarray, groups: int, units: int) -> np.ndarray:
    """[groups, 8 columns, units, *rest, unit] -> [groups, units, *rest, 8 columns, unit], flat."""
    return np.moveaxis(field, 1, -2).reshape(groups, units, -1)


def _pack_blocks32(kind: str, b: np.ndarray, pairs: bool) -> np.ndarray:
    """[groups, 8 columns, units, 2 blocks, file bytes] -> [groups, units, BYTES[kind]]:
    d[2][8] | m[2][8] (Q4_1, Q5_1) | qh[2][8][4] (Q5_0, Q5_1) | qs. qs, 4-bit types:
    [2][2 step pairs], the file's 16 bytes a column in steps of 4 (low nibble value
    4s + i, high 16 + 4s + i); Q8_0: [2][4 step pairs], each value plus 128 (unsigned
    for the op's dot product); each pair as the K-quants' (_steps). qh: bit b of byte i
    holds the fifth bit of value 4b + i (b < 4) or 16 + 4(b - 4) + i, so a step's bits
    come out by one shift and mask."""
    groups, units = b.shape[0], b.shape[2]
    minor = lambda field: _minor(field, groups, units)  # noqa: E731
    parts = [b[..., 0:2]]
    at = 2
    if kind in ("Q4_1", "Q5_1"):
        parts.append(b[..., 2:4])
        at = 4
    if kind in ("Q5_0", "Q5_1"):
        bits = np.unpackbits(b[..., at:at + 4], axis=-1, bitorder="little")  # [.., 32]: value j's fifth bit
        j = np.arange(8)[:, None]  # b
        i = np.arange(4)[None, :]
        value = np.where(j < 4, 4 * j + i, 16 + 4 * (j - 4) + i)  # [8 bits, 4 bytes]
        planes = bits[..., value]  # [.., 8 bits, 4 bytes]
        parts.append(np.packbits(np.moveaxis(planes, -2, -1), axis=-1, bitorder="little")[..., 0])  # [.., 4 bytes]
        at += 4
    if kind == "Q8_0":
        parts.append(_steps((b[..., at:at + 32] ^ np.uint8(0x80)).reshape(*b.shape[:4], 4, 8), pairs))
    else:
        parts.append(_steps(b[..., at:at + 16].reshape(*b.shape[:4], 2, 8), pairs))
    # fields [groups, 8, units, 2, (steps,) bytes] -> [groups, units, 2, (steps,) 8, bytes], field by field
    out = np.concatenate([minor(p) for p in parts], axis=-1)
    assert out.shape[-1] == BYTES[kind]
    return out


def pack_gated(kind: str, gate: np.ndarray, up: np.ndarray, *, pairs: bool) -> np.ndarray:
    """An MLP's gate and up projections (the file's bytes, alike in shape) for GGUFMatMul's
    gated form: each group of 8 gate columns followed by the up group of the same
    columns, [2 ceil(N / 8), K / UNIT[kind], BYTES[kind]], so one task of the op holds both
    halves of its output columns (Y = silu(gate) * up, no [.., 2N] tensor between)."""
    g, u = pack(kind, gate, pairs=pairs), pack(kind, up, pairs=pairs)
    if g.shape != u.shape:
        raise ValueError(f"gate and up differ in shape: {g.shape} against {u.shape}")
    return np.stack([g, u], axis=1).reshape(-1, *g.shape[1:])
