"""benchmarks/gpu/bench_cuda.py (what check.sh runs on a GPU) runs end to end here on a
tiny shape, the kernels interpreted: every section reports, lossless counts included
(its speeds are measured, never asserted)."""
from __future__ import annotations

import json

from helpers.benchmarks import load_benchmark


def test_smoke_run_reports_every_section(tmp_path):
    mod = load_benchmark("gpu/bench_cuda")
    assert mod.main(["--smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "bench_cuda.json").read_text())
    (row,) = result["shapes"]
    assert row["lossless"]["speculative_divergences"] == 0 and row["lossless"]["batch8_divergences"] == 0
    assert row["lossless"]["drafted"] > 0
    assert set(row["speed"]["verify_ratio"]) == {f"V({w})/V(1)" for w in range(1, 10)}
    assert row["speed"]["ours_tok_s"] > 0 and row["speed"]["torch_eager_tok_s"] > 0
    assert "| smoke bf16 | 0 / 0 of 4 |" in (tmp_path / "bench_cuda.md").read_text()
