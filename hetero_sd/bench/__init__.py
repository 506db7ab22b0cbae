"""`hetero-sd bench`: ours against the tools users would pick, side by side.

    hetero-sd bench --max-new-tokens 128 --out bench-results
    python -m hetero_sd.bench --peers none --config configs/cpu.yaml

Importing this package is cheap (no torch, no runtimes): the CLI registers
the subcommand with `add_parser(subparsers)` and dispatches to `run(args)`.
"""
from hetero_sd.bench.cli import add_parser, run

__all__ = ["add_parser", "run"]
