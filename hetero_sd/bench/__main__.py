"""python -m hetero_sd.bench [options]: the same as `hetero-sd bench [options]`."""
import sys

from hetero_sd.cli import main as cli_main


def main(argv: list[str] | None = None) -> int:
    return cli_main(["bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
