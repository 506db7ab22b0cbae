"""GGUF quantized weights as block-affine integers, without going through float.

A GGUF block type stores, per block of `block` values along a row, small
integers `q` and one or two fp16-derived numbers. Every type we take keeps its
values as one of two exact forms, which runtimes can hold natively:

  w = (q - zero) * scale        an integer zero point (Q4_0, Q5_0, Q8_0, Q6_K)
  w = q * scale - offset        a per-block offset (Q4_1, Q5_1, Q4_K, Q5_K)

`scale` and `offset` are the very float32 products gguf's dequantizer forms
(fp16 times a small integer, exact in float32), so `dequantize(decode(t))`
equals `gguf.quants.dequantize(t)` bit for bit (tested). A runtime that keeps
(q, scale, zero/offset) computes with the file's weights, not a re-rounding.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# GGUF type name -> (values per GGUF block, bytes per GGUF block)
SUPPORTED = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
             "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}


@dataclass
class Blocks:
    """One weight matrix [rows, cols] as block-affine integers along each row."""
    bits: int  # 4 or 8: the container width q needs (5- and 6-bit values go into 8 exactly)
    block: int  # values per scale
    q: np.ndarray  # uint8 [rows, cols], values < 2**bits
    scale: np.ndarray  # float32 [rows, cols // block]
    zero: int | None = None  # w = (q - zero) * scale
    offset: np.ndarray | None = None  # float32 [rows, cols // block]: w = q * scale - offset
    kind: str | None = None  # the GGUF type the blocks came from ("Q4_K", ...)
    raw: np.ndarray | None = None  # uint8 [rows, bytes]: the file's own bytes, for a kernel that reads them

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape

    def rows(self, start: int, stop: int) -> "Blocks":
        off = None if self.offset is None else self.offset[start:stop]
        raw = None if self.raw is None else self.raw[start:stop]
        return Blocks(self.bits, self.block, self.q[start:stop], self.scale[start:stop], self.zero, off,
                      self.kind, raw)


def dequantize(b: Blocks) -> np.ndarray:
    """The float32 weights the blocks stand for, rounded as gguf rounds them."""
    rows, cols = b.q.shape
    q = b.q.reshape(rows, cols // b.block, b.block).astype(np.float32)
    s = b.scale[..., None]
    w = (q - np.float32(b.zero)) * s if b.offset is None else q * s - b.offset[..., None]
    return w.reshape(rows, cols)


def decode(type_name: str, data: np.ndarray, rows: int, cols: int) -> Blocks:
    """`data`: the tensor's bytes (uint8, any shape holding rows * cols values)."""
    if type_name not in SUPPORTED:
        raise ValueError(f"GGUF type {type_name} has no block-affine form here; "
                         f"supported: {', '.join(SUPPORTED)}")
    per, size = SUPPORTED[type_name]
    blocks = np.ascontiguousarray(data).reshape(-1, size)
    if blocks.shape[0] * per != rows * cols:
        raise ValueError(f"{type_name} data holds {blocks.shape[0] * per} values, expected {rows} x {cols}")
    bits, block, q, scale, zero, offset = _DECODERS[type_name](blocks)
    shape = (rows, cols // block)
    return Blocks(bits, block, q.reshape(rows, cols), scale.reshape(shape), zero,
                  None if offset is None else offset.reshape(shape), type_name, blocks.reshape(rows, -1))


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes -> [n, 32]: low nibbles are values 0..15, high ones 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """[n, 4] bytes (a little-endian uint32 per block) -> [n, 32] bits as 0/16."""
    return (np.unpackbits(qh, axis=-1, bitorder="little") << 4).astype(np.uint8)


def _q4_0(b):
    return 4, 32, _nibbles(b[:, 2:]), _f16(b[:, :2]), 8, None


def _q4_1(b):  # gguf: d * q + m, i.e. q * d - (-m): negation is exact
    return 4, 32, _nibbles(b[:, 4:]), _f16(b[:, :2]), None, -_f16(b[:, 2:4])


def _q5_0(b):
    return 8, 32, _nibbles(b[:, 6:]) | _high_bits(b[:, 2:6]), _f16(b[:, :2]), 16, None


def _q5_1(b):
    return 8, 32, _nibbles(b[:, 8:]) | _high_bits(b[:, 4:8]), _f16(b[:, :2]), None, -_f16(b[:, 2:4])


def _q8_0(b):  # int8 q + 128 in a byte, zero 128: (q + 128 - 128) * d
    return 8, 32, (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8), _f16(b[:, :2]), 128, None


def k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12-byte packed 6-bit (scale, min) pairs of Q4_K / Q5_K: [n, 8] each."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_affine(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    sc, mn = k_scales(b[:, 4:16])
    return _f16(b[:, :2]) * sc, _f16(b[:, 2:4]) * mn  # exactly gguf's d and dm


def _q4_k(b):
    scale, offset = _k_affine(b)
    qs = b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return 4, 32, qs & 0x0F, scale, None, offset


def _q5_k(b):
    scale, offset = _k_affine(b)
    ql = b[:, 48:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    qh = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    return 8, 32, (ql & 0x0F).reshape(-1, 8, 32) | ((qh & 1) << 4), scale, None, offset


def _q6_k(b):  # (q - 32) * d * sc; q kept as stored, zero 32
    ql = b[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    ql = (ql & 0x0F).reshape(-1, 8, 32)
    qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    qh = (qh & 0x03).reshape(-1, 8, 32)
    scale = _f16(b[:, 208:210]) * b[:, 192:208].view(np.int8).astype(np.float32)
    return 8, 16, ql | (qh << 4), scale, 32, None


_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
             "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}
