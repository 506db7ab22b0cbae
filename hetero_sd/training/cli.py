"""`hetero-sd train-head`: train an EAGLE-3 draft head for the configured target on this host.

Wired into hetero_sd/cli.py by `add_parser(subparsers)`; the work is in training/head.py.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def add_parser(subparsers) -> None:
    from hetero_sd.training.options import TrainOptions

    d = TrainOptions()
    p = subparsers.add_parser(
        "train-head", help="train an EAGLE-3 draft head for the configured target (self-distillation, on CPU)",
        description="Make training data from the target's own responses (generated in batches) and "
                    "text found on this machine (nothing is downloaded; with the defaults over a million tokens, "
                    "about 22 minutes for SmolLM2 on 2 cores), then train a one-layer EAGLE-3 head with training-time test. Every stage is "
                    "saved under --out, so --resume continues an interrupted run. The result, in EAGLE-3's "
                    "layout, is what `drafter.kind: head` (or hybrid) with `head: auto` reads.")
    p.add_argument("--config", help="YAML whose target the head is for (default: the packaged configs/cpu.yaml)")
    p.add_argument("--out", help="output folder (default: the cache folder `head: auto` reads)")
    p.add_argument("--minutes", type=float, default=d.minutes, help=f"training time (default {d.minutes:g}; "
                                                                     "data preparation comes first)")
    p.add_argument("--steps", type=int, help="train exactly this many steps instead (reproducible on a loaded host)")
    p.add_argument("--tune-minutes", type=float, default=d.tune_minutes,
                   help="then run the configured target itself over the responses and train this long on its "
                        f"own states, at a third of the learning rate (default {d.tune_minutes:g}; 0: skip)")
    p.add_argument("--prompts", type=int, default=d.prompts, help=f"self-distillation prompts (default {d.prompts})")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens,
                   help=f"tokens per self-distilled response (default {d.max_new_tokens})")
    p.add_argument("--text-chars", type=int, default=d.text_chars,
                   help="teacher-forced text found on this machine, in characters (Python's reference manual, "
                        f"installed packages' READMEs and docstrings, standard-library code; default {d.text_chars:,})")
    p.add_argument("--gen-batch", type=int, default=d.gen_batch,
                   help=f"responses generated at once (default {d.gen_batch})")
    p.add_argument("--draft-vocab", type=int, default=d.draft_vocab,
                   help=f"draft vocabulary: the most frequent target tokens (default {d.draft_vocab})")
    p.add_argument("--ttt-steps", type=int, default=d.ttt_steps,
                   help=f"training-time-test unroll steps (default {d.ttt_steps})")
    p.add_argument("--lr", type=float, default=d.lr, help=f"peak learning rate (default {d.lr:g})")
    p.add_argument("--int8", action="store_true",
                   help="save the head's matrices as int8 rows with a scale each (a quarter of the size; the "
                        "form heads ship in with the package)")
    p.add_argument("--resume", action="store_true", help="continue from --out's data and checkpoint")
    p.set_defaults(func=run)


def run(args) -> int:
    from hetero_sd.assets import default_head, model_path
    from hetero_sd.config import load_config
    from hetero_sd.errors import ConfigError
    from hetero_sd.training.head import train_head
    from hetero_sd.training.options import TrainOptions

    cfg = load_config(args.config)
    for name in ("minutes", "steps", "prompts", "max_new_tokens", "draft_vocab", "ttt_steps", "lr", "gen_batch"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    out = Path(args.out) if args.out else default_head(model_path(cfg, None))
    if (out / "checkpoint.pt").exists() and not args.resume:
        raise ConfigError(f"{out} already holds a training run; pass --resume to continue it, "
                          "or choose another --out")
    opts = TrainOptions(prompts=args.prompts, max_new_tokens=args.max_new_tokens, text_chars=args.text_chars,
                        gen_batch=args.gen_batch, tune_minutes=args.tune_minutes,
                        draft_vocab=args.draft_vocab, ttt_steps=args.ttt_steps, lr=args.lr, minutes=args.minutes,
                        steps=args.steps)
    report = train_head(cfg, out, opts, resume=args.resume, int8=args.int8)
    print(json.dumps(report, indent=2))
    print(f"head saved to {out}", file=sys.stderr)
    return 0
