"""Smoke test: benchmarks/bench_drafters.py runs end to end on a tiny model and reports
per-kind figures for each drafter, every output checked against target-only."""
from __future__ import annotations

import json

from helpers.benchmarks import load_benchmark

def test_bench_drafters_reports_each_drafter(tiny_model_dir, tmp_path):
    bench = load_benchmark("bench_drafters")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"target: {{model: {tiny_model_dir('llama')}, backend: torch, precision: fp32}}\n"
                   "drafter: {kind: ngram}\n")
    assert bench.main(["--config", str(cfg), "--drafters", "ngram,suffix", "--kinds", "open",
                       "--max-new-tokens", "8", "--k", "2", "--out", str(tmp_path / "out")]) == 0
    summary = json.loads((tmp_path / "out" / "drafters.json").read_text())["summary"]
    assert set(summary) == {"open/ngram", "open/suffix"}
    for row in summary.values():
        assert row["lossless"] is True and len(row["acceptance_per_position"]) == 2
