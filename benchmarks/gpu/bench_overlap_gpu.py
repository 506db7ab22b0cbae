"""Drafting on the CPU while the target verifies on the GPU (issue 58's section of the GPU check).

    python benchmarks/gpu/bench_overlap_gpu.py --out DIR          # on a GPU (check.sh runs it)
    TRITON_INTERPRET=1 python benchmarks/gpu/bench_overlap_gpu.py --smoke --out DIR   # a CPU dry run

The target: a random-weight Llama-3-8B-shaped bf16 model on cuda:0 (the cuda
backend; its submit launches and returns, so the overlap's auto mode is on). The
draft: a ControlledDrafter on this host's CPU (hetero_sd/testing/controlled.py):
the target's own greedy token with probability a, a random one otherwise, each
draft token costing a declared step (a small CPU draft model's). For a = 0.5,
0.7, 0.9 and each step: tok/s of target-only, of draft-then-verify (overlap off)
and of drafting during the verify (overlap auto), side by side, with the share
of drafting hidden and the rounds a pre-draft served. Every speculative output
is checked equal to target-only's. --smoke: the tiny shape on the interpreter's
cpu device (a synchronous runner: overlap on forces the path; timings mean nothing).

Writes DIR/bench_overlap.json and DIR/bench_overlap.md. Numbers are this run's.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from hetero_sd.backends.cuda.backend import CudaBackend
from hetero_sd.engine import Engine
from hetero_sd.bench.overlap import serial_and_overlapped

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cuda import random_model, write_result  # noqa: E402


def rows(runner, vocab: int, alphas, steps_ms, k: int, new: int, overlap: str) -> list[dict]:
    prompt = list(map(int, np.random.default_rng(2).integers(0, vocab, 32)))
    alone = Engine(runner, None).generate_ids(prompt, new, target_only=True)  # (also the warm-up)
    alone = Engine(runner, None).generate_ids(prompt, new, target_only=True)
    out = []
    for step in steps_ms:
        for a in alphas:
            row = {"a": a, "step_ms": step, "k": k, "target_only_tok_s": alone.stats.tokens_per_s}
            row.update(serial_and_overlapped(runner, prompt, alone.token_ids, a, step / 1e3, k, overlap))
            row["serial_speedup"] = row["serial_tok_s"] / row["target_only_tok_s"]
            row["overlap_speedup"] = row["overlap_tok_s"] / row["target_only_tok_s"]
            out.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    return out


def markdown(result: dict) -> str:
    lines = [f"## Drafting on the CPU during the verify on {result['device']} ({result['shape']}-shaped bf16 "
             "target, ControlledDrafter)", "",
             "| a | step ms | k | accept | target-only tok/s | serial tok/s (x) | overlap tok/s (x) | hidden | "
             "hits | lossless |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lossless = "yes" if r["serial_lossless"] and r["overlap_lossless"] else "**NO**"
        lines.append(f"| {r['a']} | {r['step_ms']} | {r['k']} | {r['overlap_acceptance']:.0%} | "
                     f"{r['target_only_tok_s']:.1f} | {r['serial_tok_s']:.1f} ({r['serial_speedup']:.2f}) | "
                     f"{r['overlap_tok_s']:.1f} ({r['overlap_speedup']:.2f}) | {r['overlap_hidden']:.0%} | "
                     f"{r['overlap_hits']:.0%} | {lossless} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/gpu/out"))
    ap.add_argument("--smoke", action="store_true", help="the tiny shape on the interpreter's cpu device")
    ap.add_argument("--alphas", default="0.5,0.7,0.9")
    ap.add_argument("--steps-ms", default="0.5,2")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--new", type=int, default=96)
    args = ap.parse_args(argv)
    shape, new = ("smoke", 6) if args.smoke else ("8b", args.new)
    dev = torch.device("cuda:0" if torch.cuda.is_available() and not args.smoke else "cpu")
    ir = random_model(shape, dev)
    runner = CudaBackend().load(ir, str(dev), "bf16", 2 << 30 if dev.type == "cuda" else 2 << 20)
    result = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (Triton interpreter)",
              "shape": shape, "asynchronous": runner.asynchronous,
              "rows": rows(runner, ir.config.vocab_size, [float(a) for a in args.alphas.split(",")],
                           [float(s) for s in args.steps_ms.split(",")], args.k, new,
                           "auto" if runner.asynchronous else "on")}
    write_result(args.out, "bench_overlap", result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
