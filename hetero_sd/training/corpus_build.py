"""`hetero-sd build-corpus`: the configured target's own greedy answers to a set of
prompts, saved as a suffix corpus (drafting/corpus_file.py) that `drafter.suffix_corpus:
auto` then pins in the suffix drafter's global tree, so a fresh engine drafts from
phrases its target uses across answers (SuffixDecoding's global tree, warm from the
first request instead of after a few hundred).

Answers come from the configured engine itself, speculation on (token-identical to
the target alone), greedy, under the YAML's other generation settings (chat
template, stop strings, a constraint) as served: they are what this target, on
this backend and precision, says. Each is kept after the last suffix_max_depth
tokens of its prompt, as the drafter keeps an output. Progress is appended to
<out>.partial.jsonl (its first line the settings, which a resumed run must
match); --resume continues from it.

Wired into hetero_sd/cli.py by `add_parser(subparsers)`.
"""
from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

from hetero_sd.errors import ConfigError


def add_parser(subparsers) -> None:
    from hetero_sd.training.data import PROMPT_KINDS

    p = subparsers.add_parser(
        "build-corpus", help="save the target's own answers to many prompts as a suffix corpus (drafter.suffix_corpus)",
        description="Run the configured engine over prompts (the built-in self-distillation prompts: stories, "
                    "explanations, tips, emails, code, none of the packaged benchmark's subjects; or your own "
                    "file) and save its greedy answers as a suffix corpus, where `suffix_corpus: auto` finds it. "
                    "About 4 minutes for SmolLM2's 440 prompts on 2 cores.")
    p.add_argument("--config", help="YAML whose target (and drafter, for speed) answers (default: configs/cpu.yaml)")
    p.add_argument("--out", help="corpus file (default: the cache file `suffix_corpus: auto` reads)")
    p.add_argument("--prompts", type=int, help="use at most this many prompts (default: all)")
    p.add_argument("--prompts-file", help="prompts to answer instead: a .jsonl with a \"prompt\" field per line, "
                                          "or text with one prompt per line")
    p.add_argument("--kinds", default=",".join(PROMPT_KINDS),
                   help=f"built-in prompt kinds, comma-separated (default {','.join(PROMPT_KINDS)})")
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens per answer at most (default 256)")
    p.add_argument("--resume", action="store_true", help="continue from <out>.partial.jsonl")
    p.set_defaults(func=run)


def read_prompts(path: Path) -> list[str]:
    """A .jsonl's "prompt" fields, or a text file's non-empty lines."""
    if not path.is_file():
        raise ConfigError(f"--prompts-file {path} does not exist")
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if path.suffix != ".jsonl":
        return lines
    out = []
    for n, line in enumerate(lines, 1):
        try:
            out.append(str(json.loads(line)["prompt"]))
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"{path}:{n}: expected a JSON object with a \"prompt\" field") from None
    return out


def chosen_prompts(args) -> list[str]:
    from hetero_sd.training.data import PROMPT_KINDS, instruction_prompts

    if args.prompts_file:
        prompts = read_prompts(Path(args.prompts_file))
    else:
        kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
        unknown = sorted(set(kinds) - set(PROMPT_KINDS))
        if unknown or not kinds:
            raise ConfigError(f"--kinds: unknown kind(s) {unknown}; choose from {', '.join(PROMPT_KINDS)}")
        prompts = instruction_prompts(kinds)
        random.Random(0).shuffle(prompts)  # a --prompts limit then samples every template
    if not prompts:
        raise ConfigError("no prompts to answer")
    return prompts[:args.prompts] if args.prompts else prompts


def settings(cfg, max_new_tokens: int) -> dict:
    """What decides the answers besides the prompts: a resumed run must match them."""
    from hetero_sd.assets import model_path

    t = cfg.target
    return {"model": Path(model_path(cfg, None)).name, "backend": t.backend, "device": t.device,
            "precision": t.precision, "max_new_tokens": max_new_tokens, "tail": cfg.drafter.suffix_max_depth}


def _done(partial: Path, resume: bool, prompts: list[str], want: dict) -> list[dict]:
    """The answers an interrupted run saved (same settings, same prompts in the same order);
    the log is rewritten without a last line torn by the interruption."""
    if not partial.exists() or len(partial.read_text().strip().split("\n")) < 2:  # no answer yet (a load failed)
        partial.write_text(json.dumps(want) + "\n")
        return []
    if not resume:
        raise ConfigError(f"{partial} holds an interrupted run; pass --resume to continue it, or delete it")
    head, *lines = partial.read_text().split("\n")
    lines = [line for line in lines if line.strip()]
    try:
        had = json.loads(head)
    except ValueError:
        had = None
    if had != want:
        differ = sorted(k for k in want if not isinstance(had, dict) or had.get(k) != want[k])
        raise ConfigError(f"{partial} was made with other settings ({', '.join(differ)}); run with the same "
                          "ones, or delete it")
    done = []
    for n, line in enumerate(lines):
        try:
            done.append(json.loads(line))
        except ValueError:
            if n < len(lines) - 1:
                raise ConfigError(f"{partial}: line {n + 2} is not JSON; delete the file to start again") from None
            print(f"hetero-sd: dropped a torn last line of {partial} (answered again)", file=sys.stderr)
    if len(done) > len(prompts) or any(e.get("prompt") != p for e, p in zip(done, prompts)):
        raise ConfigError(f"{partial} answered other prompts than these; run with the same prompt options, "
                          "or delete it")
    partial.write_text("".join(json.dumps(x) + "\n" for x in [want, *done]))
    return done


def answer(engine, prompts: list[str], done: list[dict], partial: Path, max_new_tokens: int, tail: int) -> None:
    """Answer the prompts not yet in `done`, greedily, appending each to `done` and to the
    partial log as it finishes (so an interrupted run loses at most one answer)."""
    from tqdm import tqdm

    from hetero_sd.sampling import SamplingParams

    start, made = time.perf_counter(), 0
    with partial.open("a") as log, tqdm(total=len(prompts), initial=len(done), desc="answering",
                                        unit="prompt") as bar:
        for prompt in prompts[len(done):]:
            ids = engine.encode(prompt)
            res = engine.generate_ids(ids, max_new_tokens, sampling=SamplingParams())
            entry = {"prompt": prompt, "tokens": ids[-tail:] + res.token_ids}
            log.write(json.dumps(entry) + "\n")
            log.flush()
            done.append(entry)
            made += len(res.token_ids)
            bar.update(1)
            bar.set_postfix(tok_s=f"{made / (time.perf_counter() - start):.0f}")


def run(args) -> int:
    from hetero_sd.assets import default_corpus, model_path
    from hetero_sd.config import load_config
    from hetero_sd.drafting.corpus_file import save_corpus
    from hetero_sd.engine import Engine
    from hetero_sd.profiler import cpu_model

    if args.max_new_tokens <= 0 or (args.prompts is not None and args.prompts <= 0):
        raise ConfigError("--max-new-tokens and --prompts must be positive")
    cfg = load_config(args.config)
    prompts = chosen_prompts(args)
    out = Path(args.out) if args.out else default_corpus(model_path(cfg, None))
    partial = out.with_name(out.name + ".partial.jsonl")
    if out.exists():
        print(f"hetero-sd: {out} will be replaced when this run ends", file=sys.stderr)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = _done(partial, args.resume, prompts, settings(cfg, args.max_new_tokens))
    engine, start = Engine.from_config(cfg), time.perf_counter()
    try:
        answer(engine, prompts, done, partial, args.max_new_tokens, cfg.drafter.suffix_max_depth)
        vocab = engine.target_runner.vocab_size
    finally:
        engine.close()
    report = {"model": Path(model_path(cfg, None)).name, "prompts": len(done), "max_new_tokens": args.max_new_tokens,
              "tokens": sum(len(e["tokens"]) for e in done), "seconds_this_run": round(time.perf_counter() - start, 1),
              "config": Path(cfg.source).name, "host": cpu_model(),
              "source": args.prompts_file or f"built-in prompts ({args.kinds})"}
    save_corpus(out, [e["tokens"] for e in done], vocab, **report)
    partial.unlink()
    print(json.dumps(report, indent=2))
    print(f"corpus saved to {out}", file=sys.stderr)
    return 0
