"""What a batched target call costs: one decode step of B sequences against B
one-sequence steps and one B-row verify of a single sequence, on the
configured target (the default: SmolLM2 on onnxruntime int4). This is the
ceiling continuous batching can reach on this host: output tok/s at
concurrency B is at most B x (one-sequence step) / (B-sequence step).

    python benchmarks/bench_batch_step.py [--config X] [--context 380] [--batches 1,2,4,8,16]

Medians of --repeats calls, interleaved per round so host drift hits every
column alike. Not a test: speed is measured, never asserted.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from hetero_sd.backends.base import BatchItem, run_batch


def _median_ms(call, repeats: int) -> float:
    call()  # warm: shapes seen once
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def measure(target, context: list[int], batches: list[int], repeats: int) -> list[dict]:
    """Per batch size B: ms of a B-sequence decode call, of B one-sequence calls, and
    of one B-row verify of one sequence (rows past the context are rolled back)."""
    n = len(context)
    seqs = []
    for _ in range(max(batches)):
        seq = target.allocate(n + 32)
        target.forward(seq, context, 0, 1)
        seqs.append(seq)
    rows = []
    for b in batches:
        items = [BatchItem(s, [context[-1]], n, 1) for s in seqs[:b]]

        def batched():
            run_batch(target, items)
            for s in seqs[:b]:
                target.truncate(s, n)

        def one_by_one():
            for s in seqs[:b]:
                target.forward(s, [context[-1]], n, 1)
                target.truncate(s, n)

        def verify():
            target.forward(seqs[0], [context[-1]] * b, n, b)
            target.truncate(seqs[0], n)

        batch_ms, solo_ms, verify_ms = (_median_ms(f, repeats) for f in (batched, one_by_one, verify))
        rows.append({"batch": b, "batched_ms": batch_ms, "one_by_one_ms": solo_ms, "verify_rows_ms": verify_ms,
                     "speedup": solo_ms / batch_ms})
    for s in seqs:
        target.release(s)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", help="YAML config (default: the packaged configs/cpu.yaml)")
    ap.add_argument("--context", type=int, default=380, help="tokens already in each sequence")
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args(argv)
    from hetero_sd.engine import Engine

    engine = Engine.from_config(args.config, target_only=True)
    batches = [int(x) for x in args.batches.split(",")]
    text = "Write a long story about a dragon who learns to cook, with every step of every recipe. " * 40
    context = (engine.encode(text, chat_template=False) if engine.tokenizer else list(range(1, 500)))
    context = (context * (1 + args.context // max(1, len(context))))[:args.context]
    rows = measure(engine.target, context, batches, args.repeats)
    print(f"{'B':>3} {'B-sequence call':>16} {'B one-sequence calls':>21} {'B-row verify':>13} {'speedup':>8}")
    for r in rows:
        print(f"{r['batch']:>3} {r['batched_ms']:>13.1f} ms {r['one_by_one_ms']:>18.1f} ms "
              f"{r['verify_rows_ms']:>10.1f} ms {r['speedup']:>7.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
