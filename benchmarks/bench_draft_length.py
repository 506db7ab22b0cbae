"""Adaptive draft length against every fixed k, per prompt kind, in one run:
a thin wrapper over `hetero-sd bench --peers none`.

    python benchmarks/bench_draft_length.py [--target onnxruntime:cpu:int4] [--drafter ngram]
                                            [--ks 1,2,3,4,5,6,8] [any hetero-sd bench option]

Writes one YAML per fixed k and one with `k: auto` (same target placement and
drafter), so every configuration shares the one target-only baseline the
bench runs on the same loaded target. Not a test: speed is measured, never asserted.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from hetero_sd.bench.__main__ import main


def run(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], add_help=False)
    ap.add_argument("--target", default="onnxruntime:cpu:int4", help="backend:device:precision of the target")
    ap.add_argument("--drafter", default="ngram", help="ngram, or model:backend:device:precision")
    ap.add_argument("--ks", default="1,2,3,4,5,6,8", help="fixed draft lengths to compare with k: auto")
    own, rest = ap.parse_known_args(argv)
    backend, device, precision = own.target.split(":")
    if own.drafter == "ngram":
        drafter = "kind: ngram"
    else:
        _, d_backend, d_device, d_precision = own.drafter.split(":")
        drafter = f"kind: model, backend: {d_backend}, device: {d_device}, precision: {d_precision}"
    ks = [k.strip() for k in own.ks.split(",") if k.strip()] + ["auto"]
    with tempfile.TemporaryDirectory(prefix="bench-k-") as tmp:
        configs = []
        for k in ks:
            path = Path(tmp) / f"k-{k}.yaml"
            path.write_text(f"target: {{model: default, backend: {backend}, device: {device}, "
                            f"precision: {precision}}}\ndrafter: {{{drafter}, k: {k}, k_max: 8}}\n")
            configs += ["--config", str(path)]
        return main(["--peers", "none", "--out", "bench-results/draft-length", *configs, *rest])


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
