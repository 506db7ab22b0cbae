"""benchmarks/bench_head_step.py measures every head runner on a tiny head (figures measured, never asserted)."""
from __future__ import annotations

from helpers.benchmarks import load_benchmark


def test_reports_every_runner(tiny_model_dir, capsys):
    from hetero_sd.ir import load_model_ir

    mod = load_benchmark("bench_head_step")
    head = mod.make_head(load_model_ir(tiny_model_dir("llama")).config, 64)
    names = ["torch", "ort-fp32", "ort-int8@1", "ort-int4"]
    res = mod.measure(head, names, context=12, repeats=2, block=2)
    assert list(res) == names and all(r["step_ms"] > 0 and r["features_ms"] > 0 for r in res.values())
    assert mod.main(["--model", str(tiny_model_dir("llama")), "--draft-vocab", "64", "--context", "8",
                     "--repeats", "2", "--runners", "torch,ort-int8"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split()[0] for line in lines[2:]] == ["torch", "ort-int8"]
