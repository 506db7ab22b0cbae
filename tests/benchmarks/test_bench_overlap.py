"""The overlap benchmarks run end to end here (speeds measured, never asserted): the fake
device table (benchmarks/bench_overlap.py) and the GPU check's section
(benchmarks/gpu/bench_overlap_gpu.py) on the tiny shape, kernels interpreted; every
speculative output equals target-only's."""
from __future__ import annotations

import json

from helpers.benchmarks import load_benchmark


def test_fake_device_table(tmp_path):
    mod = load_benchmark("bench_overlap")
    rows = mod.measure(verify_ms=8.0, steps_ms=[2.0], alphas=[0.9], tokens=12)  # raises on a divergence
    (row,) = rows
    assert row["k"] == 3 and row["overlap_tok_s"] > 0 and row["serial_tok_s"] > 0
    assert 0 <= row["overlap_hidden"] <= 1 and row["serial_hidden"] == 0


def test_gpu_section_smoke(tmp_path):
    mod = load_benchmark("gpu/bench_overlap_gpu")
    assert mod.main(["--smoke", "--alphas", "0.9", "--steps-ms", "0.5", "--out", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "bench_overlap.json").read_text())["rows"]
    assert row["serial_lossless"] and row["overlap_lossless"] and row["overlap_acceptance"] > 0
    assert "| 0.9 | 0.5 | 4 |" in (tmp_path / "bench_overlap.md").read_text()
