"""SlabAttention against the graph that gathers attention from the pool (what a host
runs where ours cannot build or cover the model): one model loaded twice in one process
(backend options native: matmul,attention and matmul: our BlockMatMul either way), calls of
1..9 rows at several context lengths and a 512-token prefill, interleaved round by
round.

    python benchmarks/bench_attention.py [--model smollm2-135m] [--precision int4] [--rounds 3]

Each cell: the median over rounds of the median of 8 calls (each call at the same
position after a prefill of that context, then truncated back), and the ratio
SlabAttention / gathered. Both runners say how they run one-token calls
(kernel_choice). Not a test: speed is measured, never asserted.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from hetero_sd.backends.options import BackendOptions
from hetero_sd.config import resolve_model
from hetero_sd.drafting.specs import ModelSpec
from hetero_sd.loading import Loader

CONTEXTS, WIDTHS, CALLS = (64, 300, 1000), (1, 2, 3, 5, 9), 8


def load(model: str, precision: str) -> dict:
    runners = {}
    for name, kernels in (("gathered", ("matmul",)), ("SlabAttention", ("matmul", "attention"))):
        options = BackendOptions(native=kernels)
        runners[name] = Loader()(ModelSpec(model, "onnxruntime", "cpu", precision, 512 << 20, "target",
                                           options=options))
        print(f"{name}: {runners[name].kernel_choice}", flush=True)
    return runners


def calls_ms(runner, tokens: list[int], ctx: int, width: int) -> float:
    seq = runner.allocate(ctx + width + 1)
    try:
        runner.greedy(seq, tokens[:ctx], 0, 1)
        times = []
        for _ in range(CALLS):
            t0 = time.perf_counter()
            runner.greedy(seq, tokens[ctx:ctx + width], ctx, width)
            times.append(time.perf_counter() - t0)
            runner.truncate(seq, ctx)
        return statistics.median(times) * 1e3
    finally:
        runner.release(seq)


def prefill_ms(runner, tokens: list[int]) -> float:
    seq = runner.allocate(len(tokens) + 1)
    try:
        t0 = time.perf_counter()
        runner.greedy(seq, tokens, 0, 1)
        return (time.perf_counter() - t0) * 1e3
    finally:
        runner.release(seq)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--precision", default="int4")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    runners = load(str(resolve_model(args.model, None)), args.precision)
    vocab = min(r.vocab_size for r in runners.values())
    tokens = np.random.default_rng(0).integers(100, vocab - 1, max(CONTEXTS) + max(WIDTHS) + 512).tolist()
    cells: dict[tuple, list[float]] = {}
    for _ in range(args.rounds):
        for ctx in CONTEXTS:
            for width in WIDTHS:
                for name, runner in runners.items():
                    cells.setdefault((ctx, width, name), []).append(calls_ms(runner, tokens, ctx, width))
        for name, runner in runners.items():
            cells.setdefault(("prefill", 512, name), []).append(prefill_ms(runner, tokens[:512]))
    print("| cached tokens | rows | gathered ms | SlabAttention ms | ratio |\n|---|---|---|---|---|")
    for ctx, width in dict.fromkeys(k[:2] for k in cells):
        g, s = (statistics.median(cells[ctx, width, n]) for n in runners)
        print(f"| {ctx} | {width} | {g:.1f} | {s:.1f} | {s / g:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
