"""benchmarks/bench_batch_step.py runs on a tiny model and reports every batch size
(its figures are measured, never asserted)."""
from __future__ import annotations

from helpers.benchmarks import load_benchmark
from helpers.serving import write_config


def test_reports_each_batch_and_leaves_the_pool_empty(tiny_model_dir, tmp_path, capsys):
    from hetero_sd.engine import Engine

    mod = load_benchmark("bench_batch_step")
    config = write_config(tmp_path / "t.yaml", tiny_model_dir("llama"), backend="onnxruntime", precision="int4")
    assert mod.main(["--config", config, "--context", "20", "--batches", "1,3", "--repeats", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split()[0] for line in lines[1:]] == ["1", "3"]
    engine = Engine.from_config(config, target_only=True)
    rows = mod.measure(engine.target, list(range(1, 21)), [2], 1)
    assert rows[0]["batch"] == 2 and rows[0]["batched_ms"] > 0
    assert engine.target.usage().sequences == 0
