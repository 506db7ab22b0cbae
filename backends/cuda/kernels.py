"""The cuda backend's Triton kernels, each batch-invariant by construction.

A row's result never depends on how many rows the call has or what they hold:
every reduction runs in an order fixed by the model's shapes (K tiles of a
fixed width, KV blocks and splits aligned to absolute positions, a row's
softmax over its own splits in index order), never by M. Block shapes are
constants, so one compiled kernel serves every call width, and integer
arguments that vary with the call are not specialised (`do_not_specialize`):
Triton would otherwise compile M == 1 apart.

Operands are upcast to float32 before `tl.dot`: bf16 and fp16 values are
exact in tf32, so the products are the same as a 16-bit MMA's, and Triton's
interpreter (how the suite runs these on CPU tensors) multiplies 16-bit
`tl.dot` operands wrongly. fp32 and GGUF-block weights use IEEE fp32 FMAs.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["M"])
def matmul_partial(x_ptr, w_ptr, scale_ptr, offset_ptr, part_ptr, bias_ptr, M, N, K, k_per_split, zero,
                   BLOCKS: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr, HAS_OFFSET: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr, DIRECT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """part[s, m, n] = sum over split s's K range of x[m, k] * w[n, k] (float32); DIRECT
    (K in one split): y = that sum + bias, cast to part's type, with no second kernel.
    w: a float weight [N, K], or (BLOCKS) a GGUF weight's codes, scales and offsets
    (_block_values)."""
    pid_m, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rm64 = rm.to(tl.int64)  # a long prefill's activations may pass 2**31 values
    k_lo = pid_s * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + rk
        a = tl.load(x_ptr + rm64[:, None] * K + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < k_hi), other=0.0)
        wmask = (rn[None, :] < N) & (kk[:, None] < k_hi)
        if BLOCKS:
            b = _block_values(w_ptr, scale_ptr, offset_ptr, rn, kk, K, zero, wmask, GROUP, BITS, HAS_OFFSET)
        else:
            b = tl.load(w_ptr + rn[None, :] * K + kk[:, None], mask=wmask, other=0.0).to(tl.float32)
        acc += tl.dot(a.to(tl.float32), b, input_precision=PRECISION)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    out = part_ptr + (pid_s * M + rm64)[:, None] * N + rn[None, :]
    if DIRECT:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out, acc.to(part_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out, acc, mask=mask)


@triton.jit
def _block_values(q_ptr, scale_ptr, offset_ptr, rn, kk, K, zero, wmask,
                  GROUP: tl.constexpr, BITS: tl.constexpr, HAS_OFFSET: tl.constexpr):
    """The tile w[kk, rn] (float32) of a GGUF weight, dequantized exactly as
    ir/quant.dequantize does: (q - zero) * scale, or q * scale - offset (q * scale is
    exact in float32 for every block type, so a fused multiply-add rounds alike).
    BITS 4: two codes a byte, column 2j in the low nibble of byte j."""
    if BITS == 4:
        byte = tl.load(q_ptr + rn[None, :] * (K // 2) + kk[:, None] // 2, mask=wmask, other=0)
        q = ((byte >> ((kk[:, None] % 2) * 4)) & 15).to(tl.float32)
    else:
        q = tl.load(q_ptr + rn[None, :] * K + kk[:, None], mask=wmask, other=0).to(tl.float32)
    g = rn[None, :] * (K // GROUP) + kk[:, None] // GROUP
    s = tl.load(scale_ptr + g, mask=wmask, other=0.0)
    if HAS_OFFSET:
        return q * s - tl.load(offset_ptr + g, mask=wmask, other=0.0)
    return (q - zero) * s


@triton.jit(do_not_specialize=["M"])
def matmul_finish(part_ptr, bias_ptr, y_ptr, M, N, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                  BLOCK: tl.constexpr):
    """y[m, n] = (sum of the K splits, in split order) + bias, cast to y's type."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.load(part_ptr + row * N + cols, mask=mask, other=0.0)
    for s in range(1, SPLITS):
        acc += tl.load(part_ptr + (s * M + row) * N + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * N + cols, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rms_norm(x_ptr, w_ptr, y_ptr, H, eps, BLOCK: tl.constexpr):
    """One program a row: y = w * (x * rsqrt(mean(x^2) + eps)) rounded to x's type
    first, as the reference forward rounds it."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    h = (x * r).to(y_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * H + cols, (w * h).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rope(x_ptr, cos_ptr, sin_ptr, pos_ptr, heads, D, ROT, BLOCK_HALF: tl.constexpr):
    """In place, x [rows, heads, D]: the first ROT of each head rotated by its row's
    position (rotate-half form), from float32 cos/sin tables [positions, ROT]."""
    row, head = tl.program_id(0), tl.program_id(1)
    pos = tl.load(pos_ptr + row)
    half = ROT // 2
    i = tl.arange(0, BLOCK_HALF)
    mask = i < half
    base = x_ptr + (row * heads + head) * D
    a = tl.load(base + i, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(base + half + i, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + pos * ROT + i, mask=mask, other=0.0)
    s1 = tl.load(sin_ptr + pos * ROT + i, mask=mask, other=0.0)
    c2 = tl.load(cos_ptr + pos * ROT + half + i, mask=mask, other=0.0)
    s2 = tl.load(sin_ptr + pos * ROT + half + i, mask=mask, other=0.0)
    tl.store(base + i, (a * c1 - b * s1).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(base + half + i, (b * c2 + a * s2).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gated(gu_ptr, y_ptr, I, GELU: tl.constexpr, BLOCK: tl.constexpr):
    """y = act(gate) * up from one row [gate | up] of width 2I; act rounded to y's type
    before the product, as the reference's two ops round."""
    row, blk = tl.program_id(0), tl.program_id(1)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(gu_ptr + row * 2 * I + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * I + I + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        t = 2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0  # tanh, written out: one formula on every target
        a = 0.5 * g * (1.0 + t)
    else:
        a = g / (1.0 + tl.exp(-g))
    a = a.to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + row * I + cols, (a * u).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["kv_stride_h", "MAX_SPLITS"])
def attention_split(q_ptr, k_ptr, v_ptr, pos_ptr, base_ptr, part_ptr, ml_ptr,
                    heads, groups, D, kv_stride_h, window, scale, softcap, MAX_SPLITS,
                    SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, GROUP_PAD: tl.constexpr, SOFTCAP: tl.constexpr):
    """One (row, KV head, split): the online softmax of the row's queries of every head
    that shares this KV head (GQA: K and V are read once for the group) over the keys at
    absolute positions [split * SPLIT, (split + 1) * SPLIT) the row sees, in blocks of
    BLOCK_N aligned to positions. k/v: one layer's pool [kv_heads, capacity, D]; a row
    at position p of a sequence whose position 0 sits at pool slot b reads slots b..b+p.
    Writes each head's unnormalised sum (part) and its max and weight (ml). The group
    is padded to GROUP_PAD (>= 16, tl.dot's least) rows of zeros; IEEE products, so
    softmax weights are not rounded to tf32."""
    row, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    pos = tl.load(pos_ptr + row)
    base = tl.load(base_ptr + row)
    lo = tl.where(window > 0, tl.maximum(pos + 1 - window, 0), 0)
    s_lo = split * SPLIT
    s_hi = tl.minimum(s_lo + SPLIT, pos + 1)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    g = tl.arange(0, GROUP_PAD)
    gmask = g < groups
    head = kvh * groups + g
    q = tl.load(q_ptr + (row * heads + head)[:, None] * D + d[None, :], mask=gmask[:, None] & dmask[None, :],
                other=0.0).to(tl.float32)
    kv = kvh.to(tl.int64) * kv_stride_h  # a pool past 2**31 values: 64-bit offsets
    m = tl.full([GROUP_PAD], -float("inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros((GROUP_PAD, BLOCK_D), dtype=tl.float32)
    for start in range(s_lo, s_hi, BLOCK_N):
        p = start + tl.arange(0, BLOCK_N)
        valid = (p < s_hi) & (p >= lo)
        offs = kv + (base + p).to(tl.int64)[:, None] * D + d[None, :]
        k = tl.load(k_ptr + offs, mask=valid[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        if SOFTCAP:
            s = softcap * (2.0 / (1.0 + tl.exp(-2.0 * s / softcap)) - 1.0)
        s = tl.where(valid[None, :], s, -float("inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        w = tl.exp(s - m_safe[:, None])
        v = tl.load(v_ptr + offs, mask=valid[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(w, v, input_precision="ieee")
        l = l * alpha + tl.sum(w, axis=1)
        m = m_new
    slot = (row * heads + head) * MAX_SPLITS + split
    tl.store(part_ptr + slot[:, None] * BLOCK_D + d[None, :], acc, mask=gmask[:, None])
    tl.store(ml_ptr + slot * 2, m, mask=gmask)
    tl.store(ml_ptr + slot * 2 + 1, l, mask=gmask)


@triton.jit(do_not_specialize=["MAX_SPLITS"])
def attention_combine(part_ptr, ml_ptr, pos_ptr, out_ptr, heads, D, MAX_SPLITS,
                      SPLIT: tl.constexpr, BLOCK_D: tl.constexpr):
    """One (row, head): the row's own splits (those up to its position) merged in index
    order, normalised, cast to the output's type."""
    row, head = tl.program_id(0), tl.program_id(1)
    n = tl.load(pos_ptr + row) // SPLIT + 1
    d = tl.arange(0, BLOCK_D)
    base = (row * heads + head) * MAX_SPLITS
    m = tl.full([], -float("inf"), tl.float32)
    l = tl.full([], 0.0, tl.float32)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for s in range(0, n):
        ms = tl.load(ml_ptr + (base + s) * 2)
        ls = tl.load(ml_ptr + (base + s) * 2 + 1)
        part = tl.load(part_ptr + (base + s) * BLOCK_D + d)
        m_new = tl.maximum(m, ms)
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        a, b = tl.exp(m - m_safe), tl.exp(ms - m_safe)
        acc = acc * a + part * b
        l = l * a + ls * b
        m = m_new
    tl.store(out_ptr + (row * heads + head) * D + d, (acc / l).to(out_ptr.dtype.element_ty), mask=d < D)


@triton.jit
def argmax_rows(x_ptr, out_ptr, V, BLOCK: tl.constexpr):
    """One program a row: the index of the row's largest value, the lowest on a tie
    (as torch.argmax), scanning the row in blocks from its start."""
    row = tl.program_id(0)
    best = tl.full([], -float("inf"), tl.float32)
    best_i = tl.full([], 0, tl.int32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * V + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
        mx = tl.max(x, axis=0)
        i = tl.min(tl.where(x == mx, cols, V), axis=0)
        take = mx > best
        best_i = tl.where(take, i, best_i)
        best = tl.where(take, mx, best)
    tl.store(out_ptr + row, best_i)


@triton.jit
def router_topk(logits_ptr, idx_ptr, weight_ptr, E, TOPK: tl.constexpr, NORMALIZE: tl.constexpr,
                BLOCK: tl.constexpr):
    """One row of an MoE router: softmax over E experts, then the TOPK largest
    probabilities (the lowest index on a tie) in descending order, renormalised over
    the chosen ones when NORMALIZE."""
    row = tl.program_id(0)
    e = tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + row * E + e, mask=e < E, other=-float("inf")).to(tl.float32)
    ex = tl.exp(x - tl.max(x, axis=0))
    p = ex / tl.sum(ex, axis=0)
    p = tl.where(e < E, p, -1.0)
    total = tl.full([], 0.0, tl.float32)
    for j in range(TOPK):
        mx = tl.max(p, axis=0)
        i = tl.min(tl.where(p == mx, e, BLOCK), axis=0)
        tl.store(idx_ptr + row * TOPK + j, i)
        tl.store(weight_ptr + row * TOPK + j, mx)
        total += mx
        p = tl.where(e == i, -1.0, p)
    if NORMALIZE:
        for j in range(TOPK):
            w = tl.load(weight_ptr + row * TOPK + j)
            tl.store(weight_ptr + row * TOPK + j, w / total)
