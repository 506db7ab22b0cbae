"""python -m hetero_sd.bench [options]: the bench without the main CLI."""
import argparse
import sys

from hetero_sd.bench.cli import DESCRIPTION, add_arguments, run
from hetero_sd.errors import HeteroSDError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hetero_sd.bench", description=DESCRIPTION)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except HeteroSDError as exc:
        print(f"hetero-sd bench: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
