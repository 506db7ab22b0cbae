"""The row check (backends/row_check.py) decides per host whether one-token calls
of a quantized graph runner need padding; whatever it decides, a one-row decode
must equal row i of a k-row verify bitwise, and its verdict must be what an
independent comparison finds on this host."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from hetero_sd.backends import row_check
from hetero_sd.backends.options import BackendOptions, parse_native, parse_padding
from hetero_sd.backends.registry import discover
from hetero_sd.ir.errors import BackendError
from hetero_sd.ir import load_model_ir
from helpers.native import needs_avx2
from helpers.tiny_models import random_prompt

REGISTRY = discover()
QUANTIZED = [(b, p) for b in ("onnxruntime", "openvino") for p in ("int8", "int4")]
# onnxruntime's SlabAttention graph by default (BlockMatMul or MatMulNBits, whichever exact
# path was the faster here: kernel_timing.py), each of those two forced (our BlockMatMul
# always; MatMulNBits in the same SlabAttention graph, options native: attention), and
# onnxruntime's own ops alone (native: off: attention gathered from the pool, as
# where ours cannot build); OpenVINO
# runs its own either way
KERNELS = {"onnxruntime": (None, pytest.param("always", marks=needs_avx2), pytest.param("attention", marks=needs_avx2),
                           "0"), "openvino": (None,)}
def _kernel_cases(backend):
    for k in KERNELS[backend]:
        value, marks = (k.values[0], k.marks) if hasattr(k, "values") else (k, ())
        yield value, marks, value or "default"


WITH_KERNELS = [pytest.param(b, p, k, marks=m, id=f"{b}-{p}-{name}") for b, p in QUANTIZED
                for k, m, name in _kernel_cases(b)]
CONTEXTS = (3, 12, 40)


def _load(backend, folder, precision, monkeypatch, pad: str | None, kernels: str | None = None):
    """kernels: options.native (None: the default: the faster exact matmul, timed);
    "always": BlockMatMul whatever MatMulNBits' verdict; pad: options.pad_single_row."""
    if kernels is None:
        options = BackendOptions()
    elif kernels == "always":
        options = BackendOptions(native=("matmul",), native_matmul="always")
    else:
        options = BackendOptions(native=parse_native(kernels))
    options = replace(options, pad_single_row=parse_padding(pad if pad is not None else "auto"))
    return REGISTRY.get(backend).load(load_model_ir(folder), "cpu", precision, 1 << 20, options=options)


def _invariant(runner, contexts=CONTEXTS, widths=range(1, 17)) -> list[tuple[int, int]]:
    """(context, width) pairs where a verify's rows differ from one-token steps, bitwise."""
    bad, seq = [], runner.allocate(64)
    for ctx in contexts:
        prompt, cont = random_prompt(ctx, seed=ctx), random_prompt(16, seed=100 + ctx)
        runner.truncate(seq, 0)
        runner.forward(seq, prompt, 0, 1)
        single = np.stack([runner.forward(seq, [t], ctx + i, 1)[0] for i, t in enumerate(cont)])
        for width in widths:
            runner.truncate(seq, ctx)
            if not np.array_equal(runner.forward(seq, cont[:width], ctx, width), single[:width]):
                bad.append((ctx, width))
    runner.release(seq)
    return bad


@pytest.mark.parametrize("pad", [None, "1"], ids=["as-checked", "padded"])
@pytest.mark.parametrize("variant", ["llama", "mistral-swa", "qwen2"])
@pytest.mark.parametrize("backend,precision,kernels", WITH_KERNELS)
def test_one_row_decode_equals_every_verify_row(tiny_model_dir, monkeypatch, backend, precision, kernels, variant,
                                                pad):
    """For the kernel choice the check makes here and for forced padding: a one-token
    decode equals row i of a k-row verify, k = 1..16, after 3, 12 and 40 tokens."""
    runner = _load(backend, tiny_model_dir(variant), precision, monkeypatch, pad, kernels=kernels)
    assert runner.kernel_choice, "a quantized graph runner says how it runs one-token calls"
    assert _invariant(runner) == []


@pytest.mark.parametrize("backend,precision,kernels", WITH_KERNELS)
def test_the_verdict_is_what_an_unpadded_run_shows(tiny_model_dir, monkeypatch, backend, precision, kernels):
    """The check's verdict against an independent comparison of unpadded one-row calls
    on this host: exact where it says exact, and where it says padded, unpadded rows
    really differ (so the padding is not paid for nothing)."""
    unpadded = _load(backend, tiny_model_dir("llama"), precision, monkeypatch, "0", kernels=kernels)
    exact, detail = row_check.check(unpadded)
    differs = _invariant(unpadded, contexts=(5, 37), widths=(16, 5, 2))
    assert exact == (differs == []), (detail, differs)


def test_the_verdict_is_cached_per_host_and_rechecked_on_another(tiny_model_dir, monkeypatch):
    runner = _load("onnxruntime", tiny_model_dir("llama"), "int4", monkeypatch, None)
    again = _load("onnxruntime", tiny_model_dir("llama"), "int4", monkeypatch, None)
    assert "(checked" in runner.kernel_choice or "(cached" in runner.kernel_choice
    assert "(cached" in again.kernel_choice
    host = row_check.host_signature()
    monkeypatch.setattr(row_check, "host_signature", lambda: {**host, "cpu": host["cpu"] + " (another one)"})
    monkeypatch.setattr("hetero_sd.backends.graph_runner.host_signature", row_check.host_signature)
    other = _load("onnxruntime", tiny_model_dir("llama"), "int4", monkeypatch, None)
    assert "(checked" in other.kernel_choice
    # the same CPU name and named flags, one more instruction set: checked again, not trusted
    monkeypatch.setattr(row_check, "host_signature", lambda: {**host, "isa": host["isa"] + "+avx512_fp16"})
    monkeypatch.setattr("hetero_sd.backends.graph_runner.host_signature", row_check.host_signature)
    assert "(checked" in _load("onnxruntime", tiny_model_dir("llama"), "int4", monkeypatch, None).kernel_choice
    forced = _load("onnxruntime", tiny_model_dir("llama"), "int4", monkeypatch, "1")
    assert forced.kernel_choice.endswith("odd-width calls padded by one row (one-token calls to two) "
                                         "(pad_single_row: pairs)")


class _RoundsApart:
    """A runner whose calls of some widths round apart (as a GEMV path, or a kernel tail
    for an odd call's last row, whose reduction order differs): `apart(width)` says which
    calls, after the first `apart_after` calls. The check must find the cheapest exact
    padding, and settle must refuse where none is exact."""

    vocab_size = 7

    def __init__(self, apart_after: int = 0, apart=lambda width: width == 1):
        self.kv, self.apart_after, self.apart, self.calls = {}, apart_after, apart, 0

    def allocate(self, capacity):
        self.kv[len(self.kv)] = []
        return len(self.kv) - 1

    def truncate(self, seq, length):
        del self.kv[seq][length:]

    def release(self, seq):
        del self.kv[seq]

    def forward(self, seq, tokens, start, num_logits):
        del self.kv[seq][start:]
        rows = []
        for t in tokens:
            self.kv[seq].append(t)
            rows.append(np.float32(sum(self.kv[seq]) / 3) * np.ones(self.vocab_size, np.float32))
        out = np.stack(rows[len(rows) - num_logits:])
        self.calls += 1
        if self.apart(len(tokens)) and self.calls > self.apart_after:
            out[-1] = out[-1] + np.float32(1e-6) * out[-1]  # the last row's last bits differ
        return out


def test_a_one_row_path_that_rounds_apart_keeps_the_padding(tmp_path):
    exact, detail = row_check.check(_RoundsApart())
    assert not exact and "differs in a 1-row call and a 16-row one" in detail
    assert row_check.check(_RoundsApart(), "single")[0] and row_check.check(_RoundsApart(), "pairs")[0]
    assert row_check.check(_RoundsApart(apart_after=10_000))[0]
    verdict = row_check.settle(_RoundsApart(), tmp_path)
    assert verdict.padding == "single" and verdict.pad and verdict.how == "checked"
    assert row_check.settle(_RoundsApart(apart_after=10_000), tmp_path).how == "cached"  # keyed by folder
    assert row_check.settle(_RoundsApart(apart_after=10_000), tmp_path).padding == "single"  # the cached verdict stands


def test_an_odd_calls_last_row_that_rounds_apart_pads_odd_calls(tmp_path, monkeypatch):
    """As MatMulNBits' 4-bit blocks of 64 and 128 on AVX-512 hosts: padding one-token
    calls alone leaves a 3- or 5-row verify's last row apart, so the check goes on to
    pairs, and a runner that pads so rounds every row alike."""
    odd = lambda width: width % 2 == 1  # noqa: E731
    exact, detail = row_check.check(_RoundsApart(apart=odd), "single")
    assert not exact and "differs in a 3-row call" in detail
    assert row_check.check(_RoundsApart(apart=odd), "pairs")[0]
    assert row_check.settle(_RoundsApart(apart=odd), tmp_path).padding == "pairs"
    assert row_check.padded("pairs", 5) and not row_check.padded("pairs", 4) and row_check.padded("single", 1)
    assert not row_check.padded("single", 3) and not row_check.padded("none", 1)


def test_no_exact_padding_is_an_error_not_a_guess(tmp_path, monkeypatch):
    """No padding exact: an error naming why, and that verdict cached, so a later load
    says it again at once (a check takes seconds on a real model) instead of checking."""
    folder = tmp_path / "tiny"
    apart = _RoundsApart(apart=lambda width: width < 16)
    with pytest.raises(BackendError, match="tiny int4: rows round apart between call widths under every padding"):
        row_check.settle(apart, folder, "tiny int4")
    assert apart.calls > 0 and (folder / "row_check.json").exists()
    again = _RoundsApart()  # (exact under every padding: only a cached verdict can fail it)
    with pytest.raises(BackendError, match=r"under every padding.*\(cached: delete .* to check again\)"):
        row_check.settle(again, folder, "tiny int4")
    assert again.calls == 0
    listed = [(label, v.describe()) for label, v in row_check.cached_verdicts(tmp_path)]  # hetero-sd devices
    assert listed == [("tiny int4", "no padding is exact: rows round apart under every padding on this host "
                                    "(the runtime's kernel is not used for an exact target) (cached)")]
    # an override (options.pad_single_row) still wins over a cached failure
    assert row_check.settle(again, folder, forced_padding="pairs").padding == "pairs"


@pytest.mark.parametrize("backend,precision,kernels", [
    ("onnxruntime", "int4", "0"), pytest.param("onnxruntime", "int4", "always", marks=needs_avx2),
    ("openvino", "int4", None)], ids=["onnxruntime-pool", "onnxruntime-blockmatmul", "openvino"])
def test_a_draft_runner_runs_one_token_calls_unpadded(tiny_model_dir, monkeypatch, backend, precision, kernels):
    """draft_only(): a padded runner stops padding (a draft's rows are proposals), says so
    in its kernel choice, and its one-token call is the unpadded one, bitwise. (The same
    kernels both ways: by default a forced padding would send onnxruntime's matmuls to
    our BlockMatMul.)"""
    folder = tiny_model_dir("llama")
    plain = _load(backend, folder, precision, monkeypatch, "0", kernels=kernels)
    runner = _load(backend, folder, precision, monkeypatch, "1", kernels=kernels)
    assert runner.pads_single_row
    runner.draft_only()
    assert not runner.pads_single_row and "draft_only" in runner.kernel_choice
    assert "padded to two rows" not in runner.kernel_choice
    prompt, cont = random_prompt(9, seed=5), random_prompt(6, seed=6)
    got = []
    for r in (plain, runner):
        seq = r.allocate(32)
        r.forward(seq, prompt, 0, 1)
        got.append(np.stack([r.forward(seq, [t], 9 + i, 1)[0] for i, t in enumerate(cont)]))
    assert np.array_equal(got[0], got[1])


def test_int4_takes_blocks_of_128_only_where_every_layer_can():
    """Blocks of 128 need pairs padding on some hosts; a model where some layer could not
    take them (SmolLM2's hidden 576) keeps blocks of 32 everywhere, so it pays no padding
    for a partial gain (backends/onnx_weights.py)."""
    from types import SimpleNamespace

    from hetero_sd.backends.onnx_weights import requant_block, wide_blocks

    qwen = SimpleNamespace(hidden_size=1536, intermediate_size=8960, num_heads=12, head_dim=128)
    smol = SimpleNamespace(hidden_size=576, intermediate_size=1536, num_heads=9, head_dim=64)
    assert wide_blocks(qwen) and not wide_blocks(smol)
    assert requant_block(1536, 4, wide=True) == 128 and requant_block(1536, 8, head=True, wide=True) == 64
    assert requant_block(1536, 8, wide=True) == 32  # int8's weights
    assert requant_block(1536, 4) == requant_block(576, 4, wide=True) == 32


@pytest.mark.parametrize("pad", [None, "1"], ids=["as-checked", "padded"])
@pytest.mark.parametrize("backend,kernels", [pytest.param(b, k, marks=m, id=f"{b}-{name}") for b in KERNELS
                                             for k, m, name in _kernel_cases(b)])
def test_blocks_of_128_keep_every_verify_row_exact(tiny_model_dir, monkeypatch, backend, kernels, pad):
    """A model whose every K is a multiple of 128 (rows of 256 here) gets int4 blocks of 128,
    whose odd calls round their last row apart on some hosts in MatMulNBits: with the
    padding the check picks (or pairs, forced), and with our BlockMatMul (zero points
    too), a one-token decode equals row i of every 1..16-row verify."""
    folder = tiny_model_dir("qwen2-wide")
    from hetero_sd.backends.onnx_weights import wide_blocks

    assert wide_blocks(load_model_ir(folder).config)
    runner = _load(backend, folder, "int4", monkeypatch, pad, kernels=kernels)
    assert _invariant(runner) == []


@needs_avx2
@pytest.mark.parametrize("variant", ["llama", "qwen2", "llama3-rope"])
@pytest.mark.parametrize("precision,pad", [("fp32", None), ("int8", None), ("int8", "1"), ("int4", None), ("int4", "1")],
                         ids=["fp32", "int8-as-checked", "int8-padded", "int4-as-checked", "int4-padded"])  # fp32: never padded
def test_one_row_decode_equals_every_verify_row_with_our_attention(tiny_model_dir, monkeypatch, precision, variant,
                                                                   pad):
    """The same with SlabAttention (backends/native, options native: on): a one-token
    call is one row everywhere, no second attention row."""
    runner = _load("onnxruntime", tiny_model_dir(variant), precision, monkeypatch, pad, kernels="1")
    assert "our SlabAttention" in runner.kernel_choice
    assert _invariant(runner) == []


@pytest.mark.parametrize("kernels", ["0", pytest.param("1", marks=needs_avx2)])
def test_a_padded_call_fits_at_the_last_slot(tiny_model_dir, monkeypatch, kernels):
    """A sequence filled to exactly its capacity by one-token calls, each padded by a row
    (forced): the padding row has a slot of its own, whichever attention the graph runs.
    The capacity is a whole window block, so no rounding up leaves a slot to spare."""
    runner = _load("onnxruntime", tiny_model_dir("llama"), "int4", monkeypatch, "1", kernels=kernels)
    n = runner.WINDOW_BLOCK
    seq, prompt = runner.allocate(n), random_prompt(n, seed=4)
    runner.forward(seq, prompt[:n - 2], 0, 1)
    for i in (n - 2, n - 1):
        assert runner.forward(seq, [prompt[i]], i, 1).shape == (1, runner.vocab_size)
