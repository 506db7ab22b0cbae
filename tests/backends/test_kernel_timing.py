"""The timed kernel choice (backends/kernel_timing.py): where both our matmul and
MatMulNBits are exact on this host, a quantized onnxruntime runner runs whichever a
timing on the loaded model found faster, once per host, graph and runtime (cached);
the slower path's lowered graph is deleted; the choice is said in kernel_choice and
listed by hetero-sd devices. The timings here are faked where the test needs one
outcome (the real figures are the host's); time_runner itself runs for real."""
from __future__ import annotations

import os

import numpy as np
import pytest

from hetero_sd.backends import kernel_timing, ort_backend, row_check
from hetero_sd.backends.options import BackendOptions
from hetero_sd.backends.registry import discover
from hetero_sd.ir import load_model_ir
from helpers.native import needs_avx2
from helpers.tiny_models import random_prompt

REGISTRY = discover()


@pytest.fixture
def timed(monkeypatch, tmp_path):
    """A fresh cache (no choice made by another test), the defaults (our kernels on where
    they build, the choice timed), and a fake timing: `faster` names the path that wins."""
    monkeypatch.setenv("HETERO_SD_CACHE", str(tmp_path))
    calls = []

    class Fake:
        faster = "ours"

        def __call__(self, runner, repeats=kernel_timing.REPEATS):
            ours = runner._open_native
            calls.append("ours" if ours else "theirs")
            quick = (ours and self.faster == "ours") or (not ours and self.faster == "theirs")
            return (0.001, 0.002) if quick else (0.003, 0.004)

    fake = Fake()
    monkeypatch.setattr(ort_backend, "time_runner", fake)
    fake.calls = calls
    return fake


def _load(ir, precision, **options):
    """Loaded with the default options but `options` (BackendOptions' fields)."""
    return REGISTRY.get("onnxruntime").load(ir, "cpu", precision, 1 << 20, options=BackendOptions(**options))


@needs_avx2
@pytest.mark.parametrize("precision", ["int8", "int4"])
@pytest.mark.parametrize("faster", ["ours", "theirs"])
def test_the_faster_exact_path_runs_and_is_cached(tiny_model_dir, timed, precision, faster):
    timed.faster = faster
    ir = load_model_ir(tiny_model_dir("qwen2-wide"))  # 4-bit blocks of 128 with zero points
    runner = _load(ir, precision)
    assert timed.calls == ["theirs", "ours"]  # each once, MatMulNBits' graph first (its row check opened it)
    name = "BlockMatMul" if faster == "ours" else "MatMulNBits"
    assert f"quantized matmuls by {'our ' if faster == 'ours' else ''}{name} (the faster exact path, timed on " \
           f"this host: {name} 1.00/2.00 ms, " in runner.kernel_choice, runner.kernel_choice
    assert runner._open_native == (faster == "ours")
    slower = runner._graph_path("native", faster != "ours", build=False)
    assert not slower.exists() and runner._graph_path("native", faster == "ours", build=False).exists()
    timed.calls.clear()
    again = _load(ir, precision)  # a later load: the cached choice, nothing timed or lowered again
    assert timed.calls == [] and again._open_native == runner._open_native and not slower.exists()
    assert "(the faster exact path, cached on this host: " in again.kernel_choice
    prompt = random_prompt(24, seed=5)
    assert np.array_equal(runner.forward(runner.allocate(32), prompt, 0, 4),
                          again.forward(again.allocate(32), prompt, 0, 4))


@needs_avx2
@pytest.mark.parametrize("faster", ["ours", "theirs"])
def test_a_target_with_feature_outputs_runs_the_same_kernel(tiny_model_dir, timed, faster):
    """The graph with a head drafter's feature outputs is another graph, but the same
    target: it takes the choice made for the model (not timed again), so its logits are
    bitwise target-only decoding's, whichever it loads first."""
    timed.faster = faster
    ir = load_model_ir(tiny_model_dir("qwen2"))
    first, second = (ir, ir.with_features((0, 1))) if faster == "ours" else (ir.with_features((0, 1)), ir)
    a = _load(first, "int4")
    b = _load(second, "int4")
    assert timed.calls == ["theirs", "ours"] and a._open_native == b._open_native == (faster == "ours")
    prompt = random_prompt(20, seed=2)
    sa, sb = a.allocate(32), b.allocate(32)
    assert np.array_equal(a.forward(sa, prompt, 0, 5), b.forward(sb, prompt, 0, 5))
    assert all(np.array_equal(a.forward(sa, [t], 20 + i, 1), b.forward(sb, [t], 20 + i, 1)) for i, t in enumerate([3, 9, 4]))


@needs_avx2
def test_the_choice_is_the_hosts(tiny_model_dir, timed, monkeypatch):
    """Another host (its CPU flags digested) times again; so does a forced padding."""
    ir = load_model_ir(tiny_model_dir("llama"))
    _load(ir, "int4")
    assert timed.calls == ["theirs", "ours"]
    real = row_check.host_signature()
    monkeypatch.setattr(ort_backend, "host_signature", lambda: {**real, "isa": "another"})
    timed.faster = "theirs"
    assert _load(ir, "int4")._open_native is False and timed.calls[2:] == ["theirs", "ours"]
    _load(ir, "int4", pad_single_row="pairs")
    assert timed.calls[4:] == ["theirs", "ours"]


@needs_avx2
def test_gguf_times_its_file_blocks_against_matmulnbits(tiny_gguf, timed):
    """precision gguf: our GGUFMatMul on the file's blocks, or MatMulNBits with the
    minimums' side matmul, whichever is the faster here."""
    ir = load_model_ir(tiny_gguf("qwen2-wide", "Q4_K_M"))
    runner = _load(ir, "gguf")
    assert timed.calls == ["theirs", "ours"] and runner._open_native
    assert "(the faster exact path, timed on this host: GGUFMatMul 1.00/2.00 ms, MatMulNBits 3.00/4.00 ms" \
           in runner.kernel_choice


@needs_avx2
def test_no_timing_where_it_is_forced(tiny_model_dir, timed):
    """native_matmul: always: ours, untimed; our matmul off: MatMulNBits, untimed."""
    ir = load_model_ir(tiny_model_dir("llama"))
    assert _load(ir, "int4", native_matmul="always")._open_native and timed.calls == []
    assert _load(ir, "int4", native=("attention",))._open_native is False and timed.calls == []


@needs_avx2
def test_time_runner_measures_and_leaves_the_runner_as_it_was(tiny_model_dir):
    runner = _load(load_model_ir(tiny_model_dir("llama")), "int4", native_matmul="always")
    prompt = random_prompt(12, seed=1)
    seq = runner.allocate(16)
    before = runner.forward(seq, prompt, 0, 3)
    step, verify = kernel_timing.time_runner(runner, repeats=2)
    assert 0 < step < 10 and 0 < verify < 10
    assert list(runner._slabs) == [seq]  # its own sequence released
    assert np.array_equal(runner.forward(runner.allocate(16), prompt, 0, 3), before)


def test_choice_cache_round_trip_and_listing(tmp_path, monkeypatch):
    """What hetero-sd devices lists (the latest choice of each model and placement); a
    broken or other candidates' entry is timed again."""
    folder = tmp_path / "m-1"
    choice = kernel_timing.choose([kernel_timing.Timing("BlockMatMul", 0.020, 0.031),
                                   kernel_timing.Timing("MatMulNBits", 0.018, 0.040)])
    assert choice.chosen == "BlockMatMul"  # the lower step + verify, not the lower step
    kernel_timing.write_choice(folder, choice, "tiny int4")
    got = kernel_timing.cached_choice(folder, ("MatMulNBits", "BlockMatMul"))
    assert got.chosen == "BlockMatMul" and got.how == "cached" and got.timings == choice.timings
    assert kernel_timing.cached_choice(folder, ("GGUFMatMul", "MatMulNBits")) is None
    listed = [(label, c.describe()) for label, c in kernel_timing.cached_choices(tmp_path)]
    assert listed == [("tiny int4", "cached on this host: BlockMatMul 20.00/31.00 ms, MatMulNBits 18.00/40.00 ms "
                                    "(one row / 5 rows)")]
    later = kernel_timing.choose([kernel_timing.Timing("BlockMatMul", 0.030, 0.041),
                                  kernel_timing.Timing("MatMulNBits", 0.018, 0.040)])
    kernel_timing.write_choice(tmp_path / "m-0", later, "tiny int4")  # another key (a newer graph), written later
    os.utime(tmp_path / "m-0" / "kernel_choice.json", ns=(2 * 10**18, 2 * 10**18))
    assert [(label, c.chosen) for label, c in kernel_timing.cached_choices(tmp_path)] == [("tiny int4", "MatMulNBits")]
    (folder / "kernel_choice.json").write_text("{not json")
    assert kernel_timing.cached_choice(folder, ("MatMulNBits", "BlockMatMul")) is None


def test_devices_lists_the_choices(tmp_path, monkeypatch, capsys):
    from hetero_sd.cli import main

    monkeypatch.setenv("HETERO_SD_CACHE", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "200")
    choice = kernel_timing.choose([kernel_timing.Timing("GGUFMatMul", 0.019, 0.032),
                                   kernel_timing.Timing("MatMulNBits", 0.034, 0.061)])
    kernel_timing.write_choice(tmp_path / "kernel-choice" / "m-2", choice, "tiny.gguf onnxruntime:cpu gguf")
    assert main(["devices"]) == 0
    assert "  tiny.gguf onnxruntime:cpu gguf: GGUFMatMul, cached on this host: GGUFMatMul 19.00/32.00 ms, " \
           "MatMulNBits 34.00/61.00 ms (one row / 5 rows)" in capsys.readouterr().out
