"""Our target-only vs our n-gram and draft-model configurations, no peers:
a thin wrapper over `hetero-sd bench` (hetero_sd/bench/), kept for old habits.

    python benchmarks/bench_spec.py [--max-new-tokens 128] [--prompts FILE] [--config YAML ...] [--out DIR]

Any `hetero-sd bench` option works (see `python -m hetero_sd.bench --help`);
results go to bench-results/spec unless --out says otherwise. Not a test:
speed is measured here, never asserted.
"""
import sys

from hetero_sd.bench.__main__ import main

if __name__ == "__main__":
    # Later options win in argparse, so the caller's --peers / --out override these.
    sys.exit(main(["--peers", "none", "--out", "bench-results/spec", *sys.argv[1:]]))
