"""benchmarks/bench_features.py runs on a tiny model and reports every width
(its figures are measured, never asserted)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_features.py"


def _module():
    spec = importlib.util.spec_from_file_location("bench_features", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_reports_each_width(tiny_model_dir, capsys):
    mod = _module()
    argv = ["--model", str(tiny_model_dir("llama")), "--layers", "1,0", "--context", "20", "--widths", "1,3",
            "--repeats", "2"]
    assert mod.main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "logits bitwise equal" in lines[0]
    assert [line.split()[0] for line in lines[2:]] == ["1", "3"]
