"""benchmarks/gpu/ipc_roundtrip.py runs here too (--device cpu): the host arena half
and the CUDA plane's code over its CPU stand-in, the CUDA half reported as "no GPU"."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "ipc_roundtrip.py"


def test_the_round_trip_benchmark_runs_without_a_gpu():
    out = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--vocab", "1000", "--k", "3",
                          "--iters", "10", "--json"], capture_output=True, text=True, timeout=240, check=True)
    rows = {r["plane"]: r for r in json.loads(out.stdout.strip().splitlines()[-1])}
    assert rows["cuda_ipc"]["note"] == "no GPU" and rows["cuda_ipc"]["median_us"] is None
    for plane in ("host", "cpu_ipc"):
        assert rows[plane]["median_us"] > 0 and rows[plane]["mb_per_s"] > 0
    assert rows["cpu_ipc"]["handle_opens"] == 2  # two buffers, each opened once over 15 round trips
