"""`hetero-sd bench`: the argparse side. `add_parser(subparsers)` registers the
subcommand on the main CLI; `run(args)` runs it and returns the exit code."""
from __future__ import annotations

import argparse
import json
import sys

DESCRIPTION = ("Our target-only and configurations against OpenVINO GenAI, transformers and llama.cpp, on the same "
               "model, precision and token ids, one after another in this process. Writes bench.json, "
               "bench.md and bench.png into --out.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", help="JSONL of {\"id\", \"kind\", \"prompt\"}, or a packaged set: default (text), "
                                     "code (5 grounded, 5 open coding prompts)")
    p.add_argument("--config", action="append", default=[], metavar="YAML",
                   help="one of our configurations; repeat for several (default: the packaged cpu.yaml and "
                        "cpu-draft-model.yaml); the first one's target is the target-only baseline; none: "
                        "only the peers (the reference is then the first peer's plain greedy)")
    p.add_argument("--peers", default=None,
                   help="comma list of genai, transformers, llamacpp, or none (default: genai,transformers, "
                        "and llamacpp where llama-cpp-python is installed)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt (default 128)")
    p.add_argument("--kinds", help="comma list of prompt kinds to keep (default: all)")
    p.add_argument("--model", default="default",
                   help="model for every run: HF folder, .gguf, a catalog name, or default (the packaged SmolLM2)")
    p.add_argument("--draft-model", default=None,
                   help="draft model (HF folder, .gguf or catalog name) for every draft-model run: our "
                        "draft-model configurations, GenAI's draft model, transformers' assistant, llama.cpp's "
                        "draft (default: the first draft-model configuration's draft, else the target)")
    p.add_argument("--eos", choices=("ignore", "stop"), default="ignore",
                   help="ignore EOS so every run makes exactly --max-new-tokens (default), or stop at it")
    p.add_argument("--llamacpp-bin", default=None, metavar="DIR",
                   help="folder of llama.cpp's C++ tools: llama-bench runs on the same GGUF and threads before our "
                        "runs and after the peers, beside our target-only decode (docs/benchmarks.md builds them)")
    p.add_argument("--out", default="bench-results", help="folder for bench.json / bench.md / bench.png")
    p.add_argument("--json", action="store_true", help="print the JSON report on stdout (default: the table)")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="benchmark ours against the peers installed here",
                              description=DESCRIPTION)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def _list(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def options(args):
    from hetero_sd.bench.runner import BenchOptions, default_peers

    peers = _list(args.peers) if args.peers is not None else list(default_peers())
    return BenchOptions(prompts=args.prompts, configs=list(args.config), max_new_tokens=args.max_new_tokens,
                        peers=() if peers == ["none"] else tuple(peers), kinds=_list(args.kinds) or None,
                        model=args.model, draft_model=args.draft_model, eos_policy=args.eos,
                        llamacpp_bin=args.llamacpp_bin)


def run(args) -> int:
    from hetero_sd.bench.report import to_markdown
    from hetero_sd.bench.runner import log, run_bench, write_outputs

    report = run_bench(options(args))
    paths = write_outputs(report, args.out)
    if args.json:
        print(json.dumps(report))
    else:
        sys.stdout.write(to_markdown(report))
    log("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
