"""Memory and time to load a model on each backend and precision.

    python benchmarks/bench_load.py --model qwen2.5-coder-1.5b \
        --placement onnxruntime:cpu:gguf --placement openvino:CPU:gguf --placement onnxruntime:cpu:int4

Each placement loads in a fresh process (so its peak RSS is its own): once on
an empty cache (cold: lowering, quantizing, compiling) and once on the cache
that left (warm), then decodes a few tokens for a per-token time. Peak RSS is
the process's high-water mark (getrusage), which includes file pages it
mapped. Prints a markdown table; --json writes the rows.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

_CHILD = r"""
import json, resource, sys, time
from hetero_sd.backends.registry import discover
from hetero_sd.ir import load_model_ir
path, backend, device, precision, steps = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
t0 = time.perf_counter()
runner = discover().get(backend).load(load_model_ir(path), device, precision, 64 << 20)
load_s = time.perf_counter() - t0
seq = runner.allocate(64)
tok = runner.greedy(seq, [1, 2, 3, 4, 5, 6, 7, 8], 0, 1)[0]
t1 = time.perf_counter()
for i in range(steps):
    tok = runner.greedy(seq, [tok], 8 + i, 1)[0]
step_ms = (time.perf_counter() - t1) / max(steps, 1) * 1e3
print(json.dumps({"load_s": load_s, "step_ms": step_ms,
                  "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))
"""


def _measure(model: str, placement: str, cache: str, steps: int) -> dict:
    backend, device, precision = placement.split(":")
    env = dict(os.environ, HETERO_SD_CACHE=cache)
    proc = subprocess.run([sys.executable, "-c", _CHILD, model, backend, device, precision, str(steps)],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"error": f"exit {proc.returncode}: {' | '.join(tail)}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    from hetero_sd.config import resolve_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="catalog name or GGUF / HF path")
    p.add_argument("--placement", action="append", required=True, help="backend:device:precision")
    p.add_argument("--steps", type=int, default=16, help="one-token steps timed after the load")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    model = str(resolve_model(args.model, None))
    size_gb = os.path.getsize(model) / 2**30 if os.path.isfile(model) else None
    rows = []
    for placement in args.placement:
        with tempfile.TemporaryDirectory(prefix="hetero-sd-load-") as cache:
            t = time.perf_counter()
            cold = _measure(model, placement, cache, args.steps)
            warm = _measure(model, placement, cache, args.steps) if "error" not in cold else cold
        rows.append({"placement": placement, "cold": cold, "warm": warm, "wall_s": time.perf_counter() - t})
        print(f"{placement}: {rows[-1]}", file=sys.stderr)
    print(f"model {os.path.basename(model)}" + (f" ({size_gb:.2f} GiB file)" if size_gb else ""))
    print("| placement | cold load s | warm load s | peak RSS GiB (cold / warm) | ms per token |")
    print("|---|---|---|---|---|")
    for r in rows:
        c, w = r["cold"], r["warm"]
        if "error" in c:
            print(f"| {r['placement']} | {c['error']} | | | |")
            continue
        print(f"| {r['placement']} | {c['load_s']:.1f} | {w['load_s']:.1f} | "
              f"{c['peak_rss_gb']:.2f} / {w['peak_rss_gb']:.2f} | {w['step_ms']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": model, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
