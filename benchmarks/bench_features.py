"""What returning hidden states costs (take_features, backends/base.py: the input
of an EAGLE-3 draft head): a 1-token decode and a k-token verify of the target
loaded with feature layers against the same target without them, on the default
target (SmolLM2 on onnxruntime int4, configs/cpu.yaml) unless told otherwise.

    python benchmarks/bench_features.py [--model M] [--backend onnxruntime] [--precision int4]
                                        [--layers 2,15,27] [--context 200] [--widths 1,6] [--repeats 300]

Both runners are loaded side by side and called alternately (the order swapped
every round, so host drift hits both alike); the features runner's calls include
take_features. It also checks the two runners' logits are bitwise equal. Not a
test: speed is measured, never asserted.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import numpy as np

from hetero_sd.drafting.specs import ModelSpec
from hetero_sd.loading import Loader


def measure(plain, feat, context: list[int], widths: list[int], repeats: int, seed: int = 0) -> list[dict]:
    """Per width: median ms without and with features, the ratio of the medians and
    the median of the per-round ratios; logits checked bitwise equal on the way."""
    rng = np.random.default_rng(seed)
    n, rows = len(context), []
    cont = rng.integers(4, plain.vocab_size, max(widths)).tolist()
    seqs = []
    for runner in (plain, feat):
        seq = runner.allocate(n + max(widths) + 1)
        runner.forward(seq, context, 0, 1)
        seqs.append(seq)
    feat.take_features(seqs[1])

    def call(i: int, width: int) -> tuple[float, np.ndarray]:
        runner, seq = (plain, feat)[i], seqs[i]
        runner.truncate(seq, n)
        t0 = time.perf_counter()
        logits = runner.forward(seq, cont[:width], n, width)
        if i:
            runner.take_features(seq)
        return time.perf_counter() - t0, logits

    for width in widths:
        a, b = call(0, width)[1], call(1, width)[1]
        if not np.array_equal(a, b):
            raise AssertionError(f"width {width}: logits with features differ from without")
        times: list[list[float]] = [[], []]
        for r in range(repeats):
            for i in ((0, 1) if r % 2 == 0 else (1, 0)):
                times[i].append(call(i, width)[0])
        without, with_ = (statistics.median(t) for t in times)
        rows.append({"width": width, "without_ms": without * 1e3, "with_ms": with_ * 1e3,
                     "ratio": with_ / without,
                     "pairwise_ratio": statistics.median(q / p for p, q in zip(*times))})
    for runner, seq in zip((plain, feat), seqs):
        runner.release(seq)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a model folder or .gguf (default: SmolLM2, the default target)")
    ap.add_argument("--backend", default="onnxruntime")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", default="int4")
    ap.add_argument("--layers", default="2,15,27")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--widths", default="1,6")
    ap.add_argument("--repeats", type=int, default=300)
    args = ap.parse_args(argv)
    if args.model is None:
        from hetero_sd.config import default_model_path

        args.model = str(default_model_path())
    layers = tuple(int(x) for x in args.layers.split(","))
    widths = [int(x) for x in args.widths.split(",")]
    load = Loader()
    spec = ModelSpec(args.model, args.backend, args.device, args.precision, 64 << 20, "target")
    plain = load(spec)
    feat = load(dataclasses.replace(spec, features=layers))
    context = np.random.default_rng(1).integers(4, plain.vocab_size, args.context).tolist()
    rows = measure(plain, feat, context, widths, args.repeats)
    print(f"{spec.label}, layers {list(layers)}, context {args.context}, {args.repeats} rounds (logits bitwise equal)")
    print("width  without_ms  with_ms  ratio  pairwise_ratio")
    for r in rows:
        print(f"{r['width']:5d}  {r['without_ms']:10.3f}  {r['with_ms']:7.3f}  {r['ratio']:.4f}  {r['pairwise_ratio']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
