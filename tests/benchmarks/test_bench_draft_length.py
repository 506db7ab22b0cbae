"""The draft-length benchmark's arithmetic (pure functions; the run itself is a benchmark)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_draft_length.py"
_spec = importlib.util.spec_from_file_location("bench_draft_length", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _rows():
    rows = []
    for rep in range(2):
        for prompt, kind, base in (("g1", "grounded", 40.0), ("g2", "grounded", 50.0), ("o1", "open", 60.0)):
            speed = {"target-only": 1.0, "k=2": 1.5, "k=4": 1.8 if kind == "grounded" else 1.2,
                     "auto": 1.98 if kind == "grounded" else 1.5 * 1.1}
            for run, factor in speed.items():
                rows.append({"rep": rep, "prompt": prompt, "kind": kind, "run": run, "tok_s": base * factor,
                             "drafted": 0 if run == "target-only" else 10, "accepted": 0 if run == "target-only" else 5,
                             "lossless": run != "k=2" or prompt != "o1"})
    return rows


def test_speedups_best_k_and_auto_vs_best():
    rows = _rows()
    summary = bench.summarize(rows, ["target-only", "k=2", "k=4", "auto"])
    assert summary["grounded"]["k=4"]["speedup"] == pytest.approx(1.8)
    assert summary["open"]["k=2"]["lossless"] == "0/2" and summary["all"]["auto"]["lossless"] == "6/6"
    assert summary["open"]["target-only"]["acceptance"] is None and summary["open"]["auto"]["acceptance"] == 0.5
    versus = bench.auto_vs_best(rows, summary)
    assert versus["grounded"]["best"] == "k=4" and versus["open"]["best"] == "k=2"
    for kind in ("grounded", "open"):  # auto is exactly 1.1x the best in every pair: no spread
        assert versus[kind]["ratio"] == pytest.approx(1.1)
        assert versus[kind]["low"] == pytest.approx(1.1) and versus[kind]["high"] == pytest.approx(1.1)
        assert versus[kind]["held_out"] == pytest.approx(1.1)  # the other repetition picks the same best k
    md = bench.to_markdown(summary, {"target": "t", "drafter": "ngram", "prompts": 3, "reps": 2,
                                     "max_new_tokens": 8}, versus)
    assert "| grounded | **k=4** |" in md and "auto / best (k=2) | 1.100 [1.100, 1.100]" in md


def test_held_out_best_k_is_picked_on_the_other_repetitions():
    # k=2 wins repetition 0 and k=4 repetition 1: each repetition is judged
    # against the k the other one picked.
    rows = []
    for rep, (k2, k4) in enumerate(((2.0, 1.0), (1.0, 2.0))):
        for run, speed in (("target-only", 1.0), ("k=2", k2), ("k=4", k4), ("auto", 1.5)):
            rows.append({"rep": rep, "prompt": "p", "kind": "open", "run": run, "tok_s": speed,
                         "drafted": 1, "accepted": 1, "lossless": True})
    summary = bench.summarize(rows, ["target-only", "k=2", "k=4", "auto"])
    held = bench.auto_vs_best(rows, summary)["open"]["held_out"]
    assert held == pytest.approx(1.5)  # rep 0 vs k=4 (1.0), rep 1 vs k=2 (1.0)
