"""GGUF block types beyond Q8_0 for test files: encoders for the k-quants
(gguf-py only decodes them) and per-tensor type mixes like llama.cpp's.

    make_gguf(hf_dir, out, "Q4_K_M")   # tiny_models.make_gguf accepts a mix name

Encoders aim for sane weights, not llama.cpp's exact rounding: what a test
needs is valid blocks whose decoded values are known (gguf.quants.dequantize
is the oracle, and `make_roundtrip_hf` writes those values into an HF folder).
"""
from __future__ import annotations

import numpy as np

QK = 256  # values per k-quant super-block


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def encode_q4_k(w: np.ndarray) -> np.ndarray:
    """[rows, cols] float -> [rows, cols / 256 * 144] uint8 Q4_K blocks."""
    rows, cols = w.shape
    x = w.reshape(-1, 8, 32).astype(np.float32)  # super-blocks x sub-blocks x values
    lo = np.minimum(x.min(-1), 0.0)
    step = (x.max(-1) - lo) / 15
    d = _f16(step.max(-1) / 63)
    dmin = _f16((-lo).max(-1) / 63)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(step, df, out=np.zeros_like(step), where=df > 0)), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(np.divide(-lo, dminf, out=np.zeros_like(lo), where=dminf > 0)), 0, 63).astype(np.uint8)
    s, m = (df * sc)[..., None], (dminf * mn)[..., None]
    q = np.clip(np.round(np.divide(x + m, s, out=np.zeros_like(x), where=s > 0)), 0, 15).astype(np.uint8)
    scales = np.concatenate([(sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6),
                             (mn[:, :4] & 0x3F) | ((mn[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)], axis=-1)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # sub-block 2c low nibble, 2c + 1 high
    out = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales, qs], axis=-1)
    return out.reshape(rows, -1)


def encode_q6_k(w: np.ndarray) -> np.ndarray:
    """[rows, cols] float -> [rows, cols / 256 * 210] uint8 Q6_K blocks."""
    rows, cols = w.shape
    x = w.reshape(-1, 16, 16).astype(np.float32)
    step = np.abs(x).max(-1) / 31
    d = _f16(step.max(-1) / 127)
    df = d.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(step, df, out=np.zeros_like(step), where=df > 0)), -128, 127).astype(np.int8)
    s = (df * sc)[..., None]
    q = (np.clip(np.round(np.divide(x, s, out=np.zeros_like(x), where=s != 0)), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(-1, 2, 128)  # two halves of 128 values
    low, high = q & 0x0F, q >> 4
    ql = (low[..., :64] | (low[..., 64:] << 4)).reshape(-1, 128)
    h = high.reshape(-1, 2, 4, 32)
    qh = (h[:, :, 0] | (h[:, :, 1] << 2) | (h[:, :, 2] << 4) | (h[:, :, 3] << 6)).reshape(-1, 64)
    out = np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8).reshape(-1, 2)], axis=-1)
    return out.reshape(rows, -1)


def encode(kind: str, w: np.ndarray) -> np.ndarray:
    import gguf

    w = np.ascontiguousarray(w, dtype=np.float32)
    if kind == "Q4_K":
        return encode_q4_k(w)
    if kind == "Q6_K":
        return encode_q6_k(w)
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])


def _q4_k_m(name: str, shape) -> str:
    """llama.cpp's Q4_K_M choice, simplified: V, FFN-down and the output head
    at Q6_K, everything else Q4_K; rows not a multiple of 256 fall back to Q8_0."""
    if shape[-1] % QK:
        return "Q8_0"
    return "Q6_K" if name.endswith(("attn_v.weight", "ffn_down.weight", "output.weight")) else "Q4_K"


_LEGACY = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


def _legacy(name: str, shape) -> str:
    """Every 32-block type in turn, so one file exercises each."""
    return _LEGACY[sum(map(ord, name)) % len(_LEGACY)]


MIXES = {"Q4_K_M": _q4_k_m, "LEGACY": _legacy}
