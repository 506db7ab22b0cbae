"""benchmarks/bench_features.py runs on a tiny model and reports every width
(its figures are measured, never asserted)."""
from __future__ import annotations

from helpers.benchmarks import load_benchmark


def test_reports_each_width(tiny_model_dir, capsys):
    mod = load_benchmark("bench_features")
    argv = ["--model", str(tiny_model_dir("llama")), "--layers", "1,0", "--context", "20", "--widths", "1,3",
            "--repeats", "2"]
    assert mod.main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "logits bitwise equal" in lines[0]
    assert [line.split()[0] for line in lines[2:]] == ["1", "3"]
