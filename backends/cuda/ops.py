"""Launching the kernels (kernels.py) on torch tensors, and the weights they read.

`Kernels` holds the shapes that fix every reduction order on one device: the
matmul tiles, the K splits (chosen from a weight's shape and the device's SM
count, never from the number of rows), the attention's KV split and block.
Everything here is graph-capturable: no host sync, positions come as device
tensors.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton

from hetero_sd.backends.cuda import kernels as K

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64


@dataclass
class Dense:
    """A float weight [N, K] in the compute type, and an optional bias [N]."""
    w: torch.Tensor
    bias: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.w.shape)

    def nbytes(self) -> int:
        return self.w.numel() * self.w.element_size()


@dataclass
class Blocks:
    """A GGUF weight as block-affine codes (ir/quant.Blocks) on the device: w[n, k] =
    (q - zero) * scale[n, k // group], or q * scale - offset. bits 4: two codes a byte."""
    q: torch.Tensor  # uint8 [N, K] or [N, K // 2]
    scale: torch.Tensor  # float32 [N, K // group]
    offset: torch.Tensor | None
    zero: float
    group: int
    bits: int
    n: int
    k: int
    kind: str
    bias: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.k

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.offset) if t is not None)

    @staticmethod
    def from_quant(b, device: torch.device) -> "Blocks":
        q = b.q
        if b.bits == 4:
            q = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)
        put = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
        return Blocks(put(q), put(b.scale), None if b.offset is None else put(b.offset),
                      float(b.zero or 0), b.block, b.bits, b.q.shape[0], b.q.shape[1], b.kind or "?")


def stack(parts: list):
    """Weights whose rows, stacked, make one matmul (q|k|v, gate|up); a list where they
    cannot be one tensor (GGUF mixes block types: a Q4_K_M keeps attn_v in Q6_K). A
    column's result depends only on its own weight row, so stacking changes nothing."""
    if len(parts) == 1:
        return parts[0]
    biases = [p.bias for p in parts]
    bias = torch.cat(biases) if all(b is not None for b in biases) else None
    if any(b is not None for b in biases) and bias is None:
        return parts
    if all(isinstance(p, Dense) for p in parts):
        return Dense(torch.cat([p.w for p in parts]), bias)
    if not all(isinstance(p, Blocks) for p in parts):  # dense and block weights mixed
        return parts
    same = {(p.bits, p.group, p.zero, p.offset is None, p.shape[1]) for p in parts}
    if len(same) == 1:
        off = None if parts[0].offset is None else torch.cat([p.offset for p in parts])
        return Blocks(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), off,
                      parts[0].zero, parts[0].group, parts[0].bits, sum(p.n for p in parts), parts[0].k,
                      "+".join(sorted({p.kind for p in parts})), bias)
    return parts


class Kernels:
    """The launches, with the shapes that fix each reduction order on one device.

    sms: the device's multiprocessors (1 under the interpreter); a weight whose
    N tiles would leave SMs idle is split along K into a count fixed by (N, K),
    the splits summed in order. attn_split / attn_block: positions per KV split
    and per block (both powers of two, block <= split)."""

    def __init__(self, dtype: torch.dtype, sms: int = 1, attn_split: int = 256, attn_block: int = 32):
        self.dtype, self.sms = dtype, sms
        self.attn_split, self.attn_block = attn_split, attn_block
        self.precision = "ieee" if dtype == torch.float32 else "tf32"
        self._splits: dict[tuple[int, int], int] = {}

    def k_splits(self, n: int, k: int) -> int:
        key = (n, k)
        if key not in self._splits:
            tiles = triton.cdiv(n, BLOCK_N)
            want = max(1, self.sms // tiles)
            self._splits[key] = max(1, min(want, k // (4 * BLOCK_K)))
        return self._splits[key]

    def linear(self, x: torch.Tensor, weight, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [M, K] (contiguous) times the weight's rows: [M, N] in out_dtype (the compute type)."""
        if isinstance(weight, list):
            return torch.cat([self.linear(x, w, out_dtype) for w in weight], dim=-1)
        m, (n, k) = x.shape[0], weight.shape
        splits = self.k_splits(n, k)
        per = triton.cdiv(triton.cdiv(k, splits), BLOCK_K) * BLOCK_K
        splits = triton.cdiv(k, per)
        y = torch.empty((m, n), dtype=out_dtype or self.dtype, device=x.device)
        direct = splits == 1  # the sum, bias and cast in the one kernel
        part = y if direct else torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
        bias = weight.bias if weight.bias is not None else part
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N), splits)
        flags = dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, DIRECT=direct,
                     HAS_BIAS=weight.bias is not None)
        if isinstance(weight, Dense):
            K.matmul_partial[grid](x, weight.w, x, x, part, bias, m, n, k, per, 0.0, BLOCKS=False, GROUP=1,
                                   BITS=16, HAS_OFFSET=False, PRECISION=self.precision, **flags)
        else:
            off = weight.offset if weight.offset is not None else weight.scale
            K.matmul_partial[grid](x, weight.q, weight.scale, off, part, bias, m, n, k, per, weight.zero,
                                   BLOCKS=True, GROUP=weight.group, BITS=weight.bits,
                                   HAS_OFFSET=weight.offset is not None, PRECISION="ieee", **flags)
        if not direct:
            K.matmul_finish[(m, triton.cdiv(n, 256))](part, bias, y, m, n, SPLITS=splits,
                                                      HAS_BIAS=weight.bias is not None, BLOCK=256)
        return y

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """Over the last axis of x (any leading shape, contiguous)."""
        h = x.shape[-1]
        y = torch.empty_like(x)
        rows = x.numel() // h
        K.rms_norm[(rows,)](x, w, y, h, eps, BLOCK=triton.next_power_of_2(h))
        return y

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor) -> None:
        """x [rows, heads, D] in place, at each row's position."""
        rows, heads, d = x.shape
        rot = cos.shape[1]
        K.rope[(rows, heads)](x, cos, sin, pos, heads, d, rot, BLOCK_HALF=triton.next_power_of_2(rot // 2))

    def gated(self, gate_up: torch.Tensor, act: str) -> torch.Tensor:
        rows, width = gate_up.shape
        inter = width // 2
        y = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
        K.gated[(rows, triton.cdiv(inter, 256))](gate_up, y, inter, GELU=act == "gelu_tanh", BLOCK=256)
        return y

    def attention(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, pos: torch.Tensor,
                  base: torch.Tensor, window: int | None, scale: float, softcap: float | None,
                  splits: int) -> torch.Tensor:
        """q [rows, heads, D]; one layer's pool k/v [kv_heads, capacity, D]; each row
        attends to its sequence's slots base..base+pos. `splits`: KV splits a row may
        need (ceil((max position + 1) / attn_split)); a row merges only its own."""
        rows, heads, d = q.shape
        kv_heads, cap = k_pool.shape[0], k_pool.shape[1]
        bd = max(16, triton.next_power_of_2(d))
        part = torch.empty((rows, heads, splits, bd), dtype=torch.float32, device=q.device)
        ml = torch.empty((rows, heads, splits, 2), dtype=torch.float32, device=q.device)
        groups = heads // kv_heads
        K.attention_split[(rows, kv_heads, splits)](
            q, k_pool, v_pool, pos, base, part, ml, heads, groups, d, cap * d, window or 0,
            scale, softcap or 1.0, splits, SPLIT=self.attn_split, BLOCK_N=self.attn_block,
            BLOCK_D=bd, GROUP_PAD=max(16, triton.next_power_of_2(groups)), SOFTCAP=softcap is not None)
        out = torch.empty_like(q)
        K.attention_combine[(rows, heads)](part, ml, pos, out, heads, d, splits, SPLIT=self.attn_split,
                                           BLOCK_D=bd)
        return out

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        rows, v = logits.shape
        out = torch.empty((rows,), dtype=torch.int32, device=logits.device)
        K.argmax_rows[(rows,)](logits, out, v, BLOCK=1024)
        return out

    def router(self, logits: torch.Tensor, topk: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """An MoE router's choice per row: expert ids [rows, topk] (int32) and weights (float32)."""
        rows, e = logits.shape
        idx = torch.empty((rows, topk), dtype=torch.int32, device=logits.device)
        weight = torch.empty((rows, topk), dtype=torch.float32, device=logits.device)
        K.router_topk[(rows,)](logits, idx, weight, e, TOPK=topk, NORMALIZE=normalize,
                               BLOCK=triton.next_power_of_2(e))
        return idx, weight
