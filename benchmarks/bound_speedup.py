"""How fast could speculation be here? Oracle bounds from this host's costs and a
config's drafters (what limits a speedup: acceptance, draft cost or verify cost).

    python benchmarks/bound_speedup.py [--config configs/qwen-coder.yaml] [--prompts code]
                                       [--max-new-tokens 128] [--reps 5] [--eos ignore]
                                       [--out bench-results/bound]

For every prompt the target's greedy answer is made (target-only), then every
position of it is drafted teacher-forced, as a round starting there would be:
- a lookup drafter (suffix, n-gram; a hybrid's suffix trees) proposes up to 16
  tokens, as configured (its trees keep earlier prompts' answers, as in use);
- a draft model (kind: model, or a hybrid's) is run once over prompt + answer:
  its greedy token at each position, so a round starting at p would have
  `run` accepted drafts, the length of its agreement with the answer from p.
The costs are timed on this host, side by side: the target's verify of w rows
V(w) (w = 1..17) and the draft model's step D(1), at the answers' context
length, the median of --reps interleaved rounds.

From those, dynamic programming over each answer finds the cheapest sequence of
rounds that makes it, each round choosing with hindsight which drafter drafts
and how many tokens (at most its accepted run, so every draft is kept): the
speedup no draft-length policy, no hybrid choice, could beat with these
drafters on this host. It is optimistic (no draft catch-up, no Python
overhead; a draft model's prompt prefill, printed apart, is left out), so a
bound below a goal says the goal cannot be reached this way. Three versions
show what limits it: as measured, with free drafts (D = 0: the draft cost's
share) and with free verify rows (V(w) = V(1): the verify cost's share).
Each is reported on decode alone and with the target's prefill as
`hetero-sd bench`'s speedup counts it (geometric means per prompt kind).

Writes bound.{json,md} to --out. Not a test: speed is measured, never asserted.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

from tqdm import tqdm

from hetero_sd.bench.common import WARMUP_PROMPT
from hetero_sd.bench.prompts import load_prompts
from hetero_sd.config import load_config
from hetero_sd.drafting.hybrid import HybridDrafter
from hetero_sd.drafting.model import ModelDrafter
from hetero_sd.drafting.ngram import NgramDrafter
from hetero_sd.drafting.suffix import SuffixDrafter
from hetero_sd.engine import Engine
from hetero_sd.errors import ConfigError
from hetero_sd.ir.work import MAX_DRAFT_TOKENS, DraftRequest
from hetero_sd.scheduler import Round

WIDTHS = range(1, MAX_DRAFT_TOKENS + 2)


def split_drafter(drafter) -> tuple[object | None, object | None]:
    """(lookup drafter, draft model runner) of the drafters this bound understands."""
    if isinstance(drafter, HybridDrafter):
        if not isinstance(drafter.head, ModelDrafter):
            raise ConfigError("bound_speedup: a hybrid with a head is not modelled (hybrid_with: model is)")
        return drafter.suffix, drafter.head.runner
    if isinstance(drafter, (SuffixDrafter, NgramDrafter)):
        return drafter, None
    if isinstance(drafter, ModelDrafter):
        return None, drafter.runner
    raise ConfigError(f"bound_speedup: drafter {type(drafter).__name__} is not modelled "
                      "(suffix, ngram, model and hybrid with a model are)")


def agreement_runs(guess: list[int], answer: list[int]) -> list[int]:
    """runs[p]: how many of answer[p:] a greedy draft from position p gets right."""
    runs = [0] * (len(answer) + 1)
    for p in range(len(answer) - 1, -1, -1):
        runs[p] = runs[p + 1] + 1 if guess[p] == answer[p] else 0
    return runs[:len(answer)]


def lookup_runs(drafter, prompt: list[int], answer: list[int], free_rows: int = 0) -> list[int]:
    """Teacher-forced: the accepted length of the drafter's proposal at every answer position
    (position 0, the prefill's token, is never drafted). The answer then joins its trees.
    free_rows 1 where the target pads a one-token call (a lookup then proposes its first
    draft however unsure, as the engine asks it to)."""
    drafter.begin(len(prompt) + len(answer) + MAX_DRAFT_TOKENS + 1)
    runs, ctx = [0], prompt + answer[:1]
    for p in range(1, len(answer)):
        new = ctx if p == 1 else answer[p - 1:p]
        got = drafter.draft(DraftRequest(0, len(ctx) - len(new), MAX_DRAFT_TOKENS, list(new), context=ctx),
                            Round(free_rows=free_rows)).tokens
        a = 0
        while a < len(got) and p + a < len(answer) and got[a] == answer[p + a]:
            a += 1
        runs.append(a)
        ctx = ctx + answer[p:p + 1]
    drafter.reset()
    return runs


def model_runs(runner, prompt: list[int], answer: list[int]) -> tuple[list[int], float]:
    """The draft model's agreement runs over the answer, and its prompt prefill's seconds."""
    seq = runner.allocate(len(prompt) + len(answer) + 1)
    try:
        t0 = time.perf_counter()
        runner.forward(seq, prompt, 0, 1)
        prefill_s = time.perf_counter() - t0
        guess = runner.greedy(seq, answer, len(prompt), len(answer))  # guess[i] follows answer[:i + 1]
    finally:
        runner.release(seq)
    return [0] + agreement_runs(guess[:-1], answer[1:]), prefill_s


def time_widths(runner, context: list[int], widths, reps: int) -> dict[int, float]:
    """Median seconds of a w-row call after `context`, interleaved over widths."""
    seq = runner.allocate(len(context) + max(widths) + 1)
    times: dict[int, list[float]] = {w: [] for w in widths}
    try:
        runner.forward(seq, context, 0, 1)
        for _ in range(reps):
            for w in widths:
                runner.truncate(seq, len(context))
                t0 = time.perf_counter()
                runner.greedy(seq, context[:w], len(context), w)
                times[w].append(time.perf_counter() - t0)
    finally:
        runner.release(seq)
    return {w: statistics.median(t) for w, t in times.items()}


def cheapest(n: int, lookup: list[int] | None, model: list[int] | None, verify: dict[int, float],
             step: float) -> float:
    """Seconds of the cheapest rounds making answer positions 1..n-1 (DP with hindsight)."""
    best = [0.0] * (n + 1)
    for p in range(n - 1, 0, -1):
        cost = verify[1] + best[p + 1]
        for runs, price in ((lookup, 0.0), (model, step)):
            if runs is None:
                continue
            for j in range(1, min(runs[p], MAX_DRAFT_TOKENS) + 1):
                cost = min(cost, verify[1 + j] + j * price + best[min(n, p + j + 1)])
        best[p] = cost
    return best[1]


def bounds(sample: dict, verify: dict[int, float], step: float) -> dict[str, tuple[float, float]]:
    """case -> (decode speedup, speedup with the target's prefill) for one prompt."""
    lookup, model = sample["lookup"], sample["model"]
    cases = {}
    if lookup is not None and model is not None:
        cases["lookup alone"] = (lookup, None, verify, step)
        cases["model alone"] = (None, model, verify, step)
    cases["as measured"] = (lookup, model, verify, step)
    if model is not None:
        cases["free drafts"] = (lookup, model, verify, 0.0)
    cases["free verify rows"] = (lookup, model, {w: verify[1] for w in verify}, step)
    n, prefill = len(sample["answer"]), sample["prefill_s"]
    plain = (n - 1) * verify[1]
    out = {}
    for name, (lk, md, curve, price) in cases.items():
        cost = cheapest(n, lk, md, curve, price)
        out[name] = (plain / cost, (prefill + plain) / (prefill + cost))
    return out


def geo(xs) -> float:
    xs = list(xs)
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/cpu.yaml")
    ap.add_argument("--prompts", default=None, help="a prompts JSONL or a packaged set (default, code)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--eos", choices=("ignore", "stop"), default="ignore",
                    help="ignore EOS so every answer has --max-new-tokens tokens, as hetero-sd bench does (default)")
    ap.add_argument("--out", default="bench-results/bound")
    args = ap.parse_args(argv)
    cfg = load_config(args.config)
    engine = Engine.from_config(cfg)
    lookup, draft = split_drafter(engine.drafter)
    if args.eos == "ignore":
        engine.eos_ids = set()
    prompts = load_prompts(args.prompts)
    engine.generate(WARMUP_PROMPT, 8, target_only=True)
    samples = []
    for prompt in tqdm(prompts, desc="answers and drafts", unit="prompt"):
        ids = engine.encode(prompt.prompt)
        res = engine.generate_ids(ids, args.max_new_tokens, target_only=True, stop=[])
        answer = list(res.token_ids)
        sample = {"id": prompt.id, "kind": prompt.kind, "prompt_len": len(ids), "answer": answer,
                  "prefill_s": res.stats.prefill_s, "lookup": None, "model": None, "draft_prefill_s": None}
        if len(answer) < 2:  # (an answer of one token has no round to draft for)
            tqdm.write(f"{prompt.id}: the answer has {len(answer)} token(s); left out")
            continue
        if lookup is not None:
            sample["lookup"] = lookup_runs(lookup, ids, answer, int(engine.target_runner.pads_single_row))
        if draft is not None:
            sample["model"], sample["draft_prefill_s"] = model_runs(draft, ids, answer)
        samples.append(sample)
    if not samples:
        raise SystemExit("no prompt gave an answer of two tokens or more: nothing to bound")
    ctx_len = int(statistics.median(s["prompt_len"] + len(s["answer"]) // 2 for s in samples))
    context = (samples[0]["answer"] * (ctx_len // max(1, len(samples[0]["answer"])) + 1))[:ctx_len]
    verify = time_widths(engine.target, context, list(WIDTHS), args.reps)
    step = time_widths(draft, context, [1], args.reps)[1] if draft is not None else 0.0
    report = summarize(samples, verify, step, ctx_len, args.config)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bound.json").write_text(json.dumps(report, indent=1))
    (out / "bound.md").write_text(markdown(report))
    print(markdown(report))
    engine.close()
    return 0


def summarize(samples: list[dict], verify: dict[int, float], step: float, ctx_len: int, config: str) -> dict:
    per_prompt = {s["id"]: bounds(s, verify, step) for s in samples}
    kinds = sorted({s["kind"] for s in samples})
    table = {}
    for kind in kinds:
        ids = [s["id"] for s in samples if s["kind"] == kind]
        names = per_prompt[ids[0]].keys()
        table[kind] = {name: [geo(per_prompt[i][name][0] for i in ids), geo(per_prompt[i][name][1] for i in ids)]
                       for name in names}
    accept = {kind: {src: _first_draft_rate(samples, kind, src) for src in ("lookup", "model")} for kind in kinds}
    return {"config": config, "context": ctx_len, "verify_s": verify, "draft_step_s": step,
            "prefill_s": {s["id"]: s["prefill_s"] for s in samples},
            "draft_prefill_s": {s["id"]: s["draft_prefill_s"] for s in samples},
            "first_draft_right": accept, "bounds": table, "per_prompt": per_prompt}


def _first_draft_rate(samples: list[dict], kind: str, src: str) -> float | None:
    runs = [r for s in samples if s["kind"] == kind and s[src] is not None for r in s[src][1:]]
    return sum(r > 0 for r in runs) / len(runs) if runs else None


def markdown(report: dict) -> str:
    v = report["verify_s"]
    rows = " ".join(f"{w}: {v[w] / v[1]:.2f}" for w in (2, 3, 5, 7, 9, 17) if w in v)
    lines = [f"Config `{report['config']}`, context {report['context']} tokens. Verify V(1) {v[1] * 1e3:.2f} ms; "
             f"V(w)/V(1) {rows}; draft step D(1)/V(1) {report['draft_step_s'] / v[1]:.2f}.", "",
             "| kind | bound (oracle rounds) | decode speedup | with prefill | first draft right (lookup / model) |",
             "|---|---|---|---|---|"]
    for kind, table in report["bounds"].items():
        acc = report["first_draft_right"][kind]
        rate = " / ".join("-" if acc[s] is None else f"{acc[s]:.0%}" for s in ("lookup", "model"))
        for name, (dec, full) in table.items():
            lines.append(f"| {kind} | {name} | {dec:.2f}x | {full:.2f}x | {rate} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
