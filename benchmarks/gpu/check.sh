#!/usr/bin/env bash
# The cuda backend's GPU check: one command on a GPU machine, under 8 minutes on one H100.
#
#   bash benchmarks/gpu/check.sh            # writes $OUT (or benchmarks/gpu/out): check.json, check.md, logs
#
# 1. installs the project without dependencies (a GPU machine may have no package registry;
#    wheels under .whl/, made here by benchmarks/gpu/fetch_wheels.sh and carried, go in first);
# 2. runs the CUDA tests (tests/backends/cuda: kernels compiled for the GPU, CUDA graphs, streams,
#    device memory; TRITON_INTERPRET unset);
# 3. runs benchmarks/gpu/bench_cuda.py: random-weight Llama-3-8B- and 1B-shaped bf16 models,
#    lossless counts, decode tok/s against torch eager and torch + CUDA graph (cuBLAS), the
#    verify curve, the share of copy bandwidth a decode step uses, memory;
# 4. runs benchmarks/gpu/bench_overlap_gpu.py: the 8B-shaped target on the GPU with a
#    controlled-acceptance draft on the CPU (a = 0.5, 0.7, 0.9), target-only against
#    draft-then-verify and drafting during the verify (issue 58);
# 5. runs benchmarks/gpu/ipc_roundtrip.py: a 1B-shaped drafter's rows to another process on the
#    same GPU through CUDA IPC buffers against the shm host arena.
# The timeouts add up to under 10 minutes (one device call).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-benchmarks/gpu/out}"
mkdir -p "$OUT"
unset TRITON_INTERPRET
PY="${PYTHON:-python3}"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-deps --no-index .whl/*.whl > "$OUT/install.log" 2>&1 || echo "wheels: see install.log"
fi
"$PY" -m pip install -q --no-deps --no-build-isolation -e . >> "$OUT/install.log" 2>&1 || echo "install failed: see install.log"
start=$(date +%s)
timeout 180 "$PY" -m pytest -q -x -p no:cacheprovider tests/backends/cuda > "$OUT/tests.log" 2>&1
tests_rc=$?
tail -5 "$OUT/tests.log"
timeout 240 "$PY" benchmarks/gpu/bench_cuda.py --out "$OUT" > "$OUT/bench.log" 2>&1
bench_rc=$?
tail -20 "$OUT/bench.log"
timeout 90 "$PY" benchmarks/gpu/bench_overlap_gpu.py --out "$OUT" > "$OUT/overlap.log" 2>&1 || echo "overlap: see overlap.log"
timeout 40 "$PY" benchmarks/gpu/ipc_roundtrip.py --device cuda --iters 100 > "$OUT/ipc.md" 2> "$OUT/ipc.log" || echo "ipc: see ipc.log"
"$PY" - "$OUT" "$tests_rc" "$bench_rc" "$(( $(date +%s) - start ))" <<'PYEOF'
import json, pathlib, sys
out, tests_rc, bench_rc, secs = pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
tail = (out / "tests.log").read_text().strip().splitlines()[-1:] if (out / "tests.log").exists() else []
bench = json.loads((out / "bench_cuda.json").read_text()) if (out / "bench_cuda.json").exists() else None
check = {"gpu": (out / "gpu.txt").read_text().strip(), "tests_rc": tests_rc, "tests": tail,
         "bench_rc": bench_rc, "bench": bench, "seconds": secs}
(out / "check.json").write_text(json.dumps(check, indent=1))
md = f"# GPU check\n\n{check['gpu']}\n\nCUDA tests: rc {tests_rc}, {' '.join(tail)}\n\n"
md += (out / "bench_cuda.md").read_text() if (out / "bench_cuda.md").exists() else f"benchmark failed (rc {bench_rc})\n"
for name, what in (("bench_overlap.md", "overlap section"), ("ipc.md", "CUDA IPC round trip")):
    part = out / name
    md += "\n" + (part.read_text() if part.exists() and part.stat().st_size else f"{what}: no output (see its log)\n")
(out / "check.md").write_text(md)
print(md)
PYEOF
