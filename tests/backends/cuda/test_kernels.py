"""Each Triton kernel of the cuda backend against a float64 reference, and bitwise row
invariance: row i of an M-row call equals the same row computed alone, M = 1..17,
for every kernel and precision (the attention at three context lengths, with rows
of several sequences in one call).

Tolerances, relative to the reference's largest magnitude: fp32 1e-5 (float
reassociation only); bf16 and fp16 outputs 2**-7 and 2**-10 (one rounding of
the result, the sums in float32); GGUF blocks 1e-5 (the file's values exactly,
float32 sums)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.gguf_mixes import encode
from hetero_sd.backends.cuda.ops import Blocks, Dense, Kernels
from hetero_sd.ir import quant

from .conftest import DEVICE

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {"fp32": 1e-5, "bf16": 2 ** -7, "fp16": 2 ** -10}
ROWS = range(1, 18)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    err = (got.double().cpu() - want).abs().max().item()
    scale = want.abs().max().item()
    assert err <= tol * scale + 1e-12, f"{what}: error {err:.3g} over {tol * scale:.3g}"


def _invariant(call, x: torch.Tensor, what: str) -> None:
    """call(x[:m]) row i == call(x[i:i+1]), bitwise, for m = 1..17."""
    alone = [call(x[i:i + 1]).cpu() for i in range(max(ROWS))]
    for m in ROWS:
        got = call(x[:m]).cpu()
        for i in range(m):
            assert torch.equal(got[i:i + 1], alone[i]), f"{what}: row {i} of {m} differs from the row alone"


def _blocks(kind: str, n: int, k: int, seed: int) -> tuple[Blocks, torch.Tensor]:
    w = torch.randn(n, k, generator=_gen(seed)).numpy()
    b = quant.decode(kind, encode(kind, w), n, k)
    return Blocks.from_quant(b, torch.device(DEVICE)), torch.from_numpy(quant.dequantize(b)).double()


@pytest.mark.parametrize("precision", DTYPES)
@pytest.mark.parametrize("sms", [1, 8])  # 8: K split in two (520 = 2 x 256 + a tail), summed in order
def test_matmul(precision, sms):
    dtype, dev = DTYPES[precision], torch.device(DEVICE)
    ops = Kernels(dtype, sms=sms)
    x = torch.randn(17, 520, generator=_gen(1)).to(dev, dtype)
    w = torch.randn(80, 520, generator=_gen(2)).to(dev, dtype)
    bias = torch.randn(80, generator=_gen(3)).to(dev, dtype)
    assert ops.k_splits(80, 520) == (2 if sms == 8 else 1)
    weight = Dense(w, bias)
    want = x.double().cpu() @ w.double().cpu().T + bias.double().cpu()
    _close(ops.linear(x, weight), want, TOL[precision], f"matmul {precision}")
    _close(ops.linear(x, weight, torch.float32), want, 1e-5, f"matmul {precision} -> fp32")
    _invariant(lambda r: ops.linear(r.contiguous(), weight), x, f"matmul {precision} sms={sms}")


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q8_0", "Q4_1", "Q5_0"])
def test_matmul_gguf_blocks(kind):
    dev = torch.device(DEVICE)
    ops = Kernels(torch.bfloat16, sms=4)  # 4: the K of 512 split in two
    weight, w = _blocks(kind, 72, 512, seed=4)
    x = torch.randn(17, 512, generator=_gen(5)).to(dev, torch.bfloat16)
    want = x.double().cpu() @ w.T
    _close(ops.linear(x, weight, torch.float32), want, 1e-5, f"{kind} matmul")
    _invariant(lambda r: ops.linear(r.contiguous(), weight, torch.float32), x, f"{kind} matmul")


@pytest.mark.parametrize("precision", DTYPES)
def test_rows_kernels(precision):
    """RMSNorm, the gated activations, RoPE: against float64, and row-invariant."""
    dtype, dev = DTYPES[precision], torch.device(DEVICE)
    ops = Kernels(dtype)
    x = torch.randn(17, 96, generator=_gen(6)).to(dev, dtype)
    g = (torch.rand(96, generator=_gen(7)) + 0.5).to(dev, dtype)
    xd = x.double().cpu()
    want = g.double().cpu() * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5)
    _close(ops.rms_norm(x, g, 1e-5), want, 2 * TOL[precision], "rms_norm")
    _invariant(lambda r: ops.rms_norm(r.contiguous(), g, 1e-5), x, f"rms_norm {precision}")

    gu = torch.randn(17, 2 * 48, generator=_gen(8)).to(dev, dtype)
    gate, up = gu.double().cpu().chunk(2, dim=-1)
    for act, ref in (("silu", torch.nn.functional.silu(gate)),
                     ("gelu_tanh", torch.nn.functional.gelu(gate, approximate="tanh"))):
        _close(ops.gated(gu, act), ref * up, 2 * TOL[precision] + 1e-6, act)
        _invariant(lambda r: ops.gated(r.contiguous(), act), gu, f"{act} {precision}")

    rot = 24  # partial rotary (Phi-4-mini's kind): the last 8 of each head pass through
    pos = torch.arange(17, dtype=torch.int32) * 5
    table = torch.arange(81).double()[:, None] / (1e4 ** (torch.arange(0, rot, 2).double() / rot))[None, :]
    emb = torch.cat([table, table], -1)  # [positions, rot]: looked up by each row's position
    cos, sin = emb.cos().float().to(dev), emb.sin().float().to(dev)
    q = torch.randn(17, 3, 32, generator=_gen(9)).to(dev, dtype)
    qd, c, s = q.double().cpu(), emb.cos()[pos.long(), None, :], emb.sin()[pos.long(), None, :]
    head, rest = qd[..., :rot], qd[..., rot:]
    want = torch.cat([head * c + torch.cat([-head[..., rot // 2:], head[..., :rot // 2]], -1) * s, rest], -1)
    got = q.clone()
    ops.rope_(got, cos, sin, pos.to(dev))
    _close(got, want, 2 * TOL[precision], "rope")
    for m in ROWS:  # row i alone at its own position
        full = q[:m].clone()
        ops.rope_(full, cos, sin, pos[:m].to(dev))
        for i in range(m):
            one = q[i:i + 1].clone()
            ops.rope_(one, cos, sin, pos[i:i + 1].to(dev))
            assert torch.equal(full[i:i + 1], one), f"rope {precision}: row {i} of {m}"


def test_argmax_and_router():
    dev = torch.device(DEVICE)
    ops = Kernels(torch.float32)
    logits = torch.randn(17, 2500, generator=_gen(10)).to(dev)
    logits[3, 7] = logits[3, 2400] = logits[3].max() + 1  # a tie: the lower index, as torch.argmax
    assert ops.argmax(logits).cpu().tolist() == logits.cpu().argmax(-1).tolist()
    _invariant(lambda r: ops.argmax(r.contiguous()), logits, "argmax")

    router = torch.randn(17, 8, generator=_gen(11)).to(dev)
    probs = torch.softmax(router.double().cpu(), -1)
    top, chosen = torch.topk(probs, 2, dim=-1)
    for normalize in (True, False):
        idx, weight = ops.router(router, 2, normalize)
        assert idx.cpu().long().tolist() == chosen.tolist()
        want = top / top.sum(-1, keepdim=True) if normalize else top
        _close(weight, want, 1e-6, "router weights")
        _invariant(lambda r: torch.cat([t.float() for t in ops.router(r.contiguous(), 2, normalize)], -1),
                   router, "router")


def _attention_reference(q, k_pool, v_pool, pos, base, window, scale, softcap):
    out = []
    groups = q.shape[1] // k_pool.shape[0]
    for r in range(q.shape[0]):
        p, b = int(pos[r]), int(base[r])
        lo = max(0, p + 1 - window) if window else 0
        k = k_pool[:, b + lo:b + p + 1].double().repeat_interleave(groups, 0)
        v = v_pool[:, b + lo:b + p + 1].double().repeat_interleave(groups, 0)
        s = torch.einsum("hd,hnd->hn", q[r].double(), k) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        out.append(torch.einsum("hn,hnd->hd", torch.softmax(s, -1), v))
    return torch.stack(out)


@pytest.mark.parametrize("precision,window,softcap", [(p, None, None) for p in DTYPES] +
                         [("bf16", 20, None), ("bf16", None, 30.0)])  # a window (Mistral), a softcap (Gemma)
def test_attention(precision, window, softcap):
    """Rows of three sequences (contexts up to 9, 40 and 75 positions: one, two and three
    KV splits of 32) in one call; each row equals itself alone, M = 1..17."""
    dtype, dev = DTYPES[precision], torch.device(DEVICE)
    ops = Kernels(dtype, attn_split=32, attn_block=16)
    heads, kv_heads, d, cap = 2, 1, 16, 160  # grouped: two query heads read one KV head
    k_pool = torch.randn(kv_heads, cap, d, generator=_gen(12)).to(dev, dtype)
    v_pool = torch.randn(kv_heads, cap, d, generator=_gen(13)).to(dev, dtype)
    bases, lengths = [0, 10, 60], [9, 40, 75]
    rng = np.random.default_rng(14)
    seq = rng.integers(0, 3, size=17)
    pos = torch.tensor([int(rng.integers(0, lengths[s])) for s in seq], dtype=torch.int32)
    pos[:3] = torch.tensor([8, 39, 74], dtype=torch.int32)
    seq[:3] = [0, 1, 2]
    base = torch.tensor([bases[s] for s in seq], dtype=torch.int32)
    q = torch.randn(17, heads, d, generator=_gen(15)).to(dev, dtype)
    scale = d ** -0.5

    def call(rows, idx):
        p, b = pos[idx].to(dev), base[idx].to(dev)
        return ops.attention(rows.contiguous(), k_pool, v_pool, p, b, window, scale, softcap,
                             int(p.max()) // 32 + 1)

    want = _attention_reference(q.cpu(), k_pool.cpu(), v_pool.cpu(), pos, base, window, scale, softcap)
    _close(call(q, slice(None)), want, 2 * TOL[precision] + 1e-6, "attention")
    alone = [call(q[i:i + 1], slice(i, i + 1)).cpu() for i in range(17)]
    for m in ROWS:
        got = call(q[:m], slice(0, m)).cpu()
        for i in range(m):
            assert torch.equal(got[i:i + 1], alone[i]), f"attention {precision}: row {i} of {m}"
    # more splits than any row needs (as a CUDA graph captures): each row merges only its own
    wide = ops.attention(q.contiguous(), k_pool, v_pool, pos.to(dev), base.to(dev), window, scale, softcap, 8)
    assert torch.equal(wide.cpu(), call(q, slice(None)).cpu())
