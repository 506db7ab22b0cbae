"""The GenAI comparison benchmark's arithmetic (pure functions; the run itself is a benchmark)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from hetero_sd.bench.common import Sample

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_vs_genai.py"
_spec = importlib.util.spec_from_file_location("bench_vs_genai", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _sample(pid, kind, total_s, prefill_s=0.1):
    return Sample(pid, kind, 10, list(range(11)), total_s, prefill_s)


def test_ratios_pair_runs_of_the_same_prompt_and_repetition():
    samples = {"ours x": [], bench.GENAI: []}
    for rep, slow in ((0, 1.0), (1, 2.0)):  # the machine halves its speed between repetitions
        for pid, kind in (("g", "grounded"), ("o", "open")):
            samples[bench.GENAI].append((rep, _sample(pid, kind, 1.0 * slow)))
            samples["ours x"].append((rep, _sample(pid, kind, 1.25 * slow)))  # always 0.8x GenAI
    summary = bench.summarize(samples)
    for kind in ("grounded", "open", "all"):
        vs = summary[kind]["ours x"]["vs_genai"]
        assert vs["ratio"] == pytest.approx(0.8) and vs["low"] == pytest.approx(0.8)
        # decode excludes the (equal) 0.1 s to the first token: 0.9/1.15 and 1.9/2.4
        assert summary[kind]["ours x"]["decode_vs_genai"]["ratio"] == pytest.approx((0.9 / 1.15 * 1.9 / 2.4) ** 0.5)
        assert "vs_genai" not in summary[kind][bench.GENAI]
    md = bench.to_markdown(summary, {"hints": "h", "prompts": 2, "reps": 2, "max_new_tokens": 11})
    assert "| open | ours x |" in md and "0.800x [0.800, 0.800]" in md
