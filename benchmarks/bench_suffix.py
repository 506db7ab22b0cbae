"""Suffix decoding across requests: what earlier outputs add, in one process.

    python benchmarks/bench_suffix.py [--config configs/cpu.yaml] [--prompts PATH] [--kinds grounded,open]
                                      [--k 8] [--max-new-tokens 128] [--eos stop] [--suffix-factor 1.0]
                                      [--suffix-min-prob 0.1] [--suffix-max-depth 24] [--json OUT.json]
    python benchmarks/bench_suffix.py --versus-ngram [--reps 1] [--eos ignore] ...

The engine is loaded once from --config (default: the packaged cpu.yaml,
onnxruntime int4 SmolLM2) with its drafter replaced by `kind: suffix` and a
fixed draft length (--k; `auto` keeps the adaptive policy, whose choices then
depend on timings), and runs the prompts (default: the packaged set, the same
10 grounded and open prompts as shared/bench/prompts.jsonl) three times:

    pass 1  the global tree starts empty (a warm-up's output is cleared first)
    pass 2  the same prompts again: the global tree holds pass 1's outputs
    pass 3  after clear_global(): pass 1's conditions again (greedy, fixed k:
            the same figures exactly, which the report checks)

Per pass and prompt kind: acceptance (accepted / drafted), accepted drafts per
round, tokens per target call (accepted + the bonus), the share of drafted
tokens that came from the global tree, the drafter's time per round, and tok/s
(a loaded host's tok/s drift; compare passes, not hosts). Every pass's outputs are checked
equal to pass 1's (greedy output does not depend on drafts).

--versus-ngram instead loads the target twice, once with the suffix drafter and
once with the config's n-gram drafter (each with the config's draft length,
`k: auto` in cpu.yaml, unless --k is given), and runs every prompt target-only,
with n-gram drafts and with suffix drafts back to back, in an order that
rotates: tok/s ratios of runs made seconds apart, which a loaded host's drift
(10-50% over minutes) cannot bias the way separate `hetero-sd bench`
configurations can. Each repetition starts with an empty global tree (the
earlier prompts' outputs of that repetition are in it, as in use). Not a
test: nothing is asserted about speed.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from hetero_sd.bench.common import WARMUP_PROMPT
from hetero_sd.bench.prompts import load_prompts
from hetero_sd.config import load_config
from hetero_sd.engine import Engine
from hetero_sd.scheduler.draft_length import FixedDraftLength

PASSES = ("pass 1", "pass 2", "pass 3 (after clear_global)")


class SourceCounter:
    """Wraps the suffix drafter's draft(): drafted tokens per source (local / global), and
    each call's time: the first of a request (it indexes the prompt) apart from the others."""

    def __init__(self, drafter):
        self.drafter, self.inner = drafter, drafter.draft
        self.tokens = {"local": 0, "global": 0}
        self.first_s: list[float] = []
        self.call_s: list[tuple[float, int]] = []  # (seconds, context length)
        drafter.draft = self  # an instance attribute: the engine calls this

    def __call__(self, req, rnd=None):
        t0 = time.perf_counter()
        result = self.inner(req, rnd)
        seconds = time.perf_counter() - t0
        if req.base_len == 0:
            self.first_s.append(seconds)
        else:
            self.call_s.append((seconds, req.base_len + len(req.new_tokens)))
        if result.tokens:
            self.tokens[self.drafter.source] += len(result.tokens[:req.k])
        return result

    def take(self) -> dict:
        out, self.tokens = self.tokens, {"local": 0, "global": 0}
        return out

    def costs(self) -> dict:
        """Per-call drafting time (ms): mean, p99 and max of the calls after a request's first,
        the mean of first calls, and the contexts' mean and largest length."""
        calls = sorted(s for s, _ in self.call_s)
        if not calls:
            return {}
        return {"calls": len(calls), "mean_ms": 1e3 * statistics.fmean(calls),
                "p99_ms": 1e3 * calls[min(len(calls) - 1, int(0.99 * len(calls)))], "max_ms": 1e3 * calls[-1],
                "first_call_mean_ms": 1e3 * statistics.fmean(self.first_s) if self.first_s else None,
                "context_mean": statistics.fmean(n for _, n in self.call_s),
                "context_max": max(n for _, n in self.call_s)}


def run_pass(engine, prompts, ids: dict, new_tokens: int, counter: SourceCounter) -> list[dict]:
    rows = []
    for p in prompts:
        res = engine.generate_ids(ids[p.id], new_tokens, stop=[])
        s = res.stats
        rows.append({"prompt": p.id, "kind": p.kind, "tokens": list(res.token_ids), "new": len(res.token_ids),
                     "rounds": s.rounds, "drafted": s.drafted, "accepted": s.accepted, "total_s": s.total_s,
                     "draft_s": s.draft_s, "from": counter.take()})
    return rows


def summarize(passes: dict[str, list[dict]]) -> dict:
    """Per pass and kind (and all): acceptance, accepted per round, tokens per call, global share, tok/s."""
    out = {}
    for name, rows in passes.items():
        for kind in sorted({r["kind"] for r in rows}) + ["all"]:
            mine = [r for r in rows if kind in ("all", r["kind"])]
            drafted, accepted = sum(r["drafted"] for r in mine), sum(r["accepted"] for r in mine)
            rounds, new = sum(r["rounds"] for r in mine), sum(r["new"] for r in mine)
            glob = sum(r["from"]["global"] for r in mine)
            out.setdefault(name, {})[kind] = {
                "acceptance": accepted / drafted if drafted else None,
                "accepted_per_round": accepted / rounds if rounds else None,
                "tokens_per_call": new / rounds if rounds else None,
                "global_share": glob / drafted if drafted else None,
                "tok_s": new / sum(r["total_s"] for r in mine), "drafted": drafted, "accepted": accepted,
                "rounds": rounds,
                "draft_ms_per_round": 1e3 * sum(r["draft_s"] for r in mine) / rounds if rounds else None}
    return out


def checks(passes: dict[str, list[dict]]) -> dict:
    first, *others = passes.values()
    same_tokens = all(r["tokens"] == f["tokens"] for rows in others for r, f in zip(rows, first))
    last = list(passes.values())[-1]
    same_figures = all((r["drafted"], r["accepted"], r["rounds"]) == (f["drafted"], f["accepted"], f["rounds"])
                       for r, f in zip(last, first))
    return {"outputs_equal_pass_1": same_tokens, "pass_3_figures_equal_pass_1": same_figures}


def to_markdown(summary: dict, meta: dict, check: dict) -> str:
    pct = lambda v: "-" if v is None else f"{v:.1%}"  # noqa: E731
    num = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    lines = [f"Suffix decoding on {meta['target']}: {meta['prompts']} prompts x {meta['max_new_tokens']} new tokens "
             f"(EOS {meta['eos']}), k={meta['k']}, {meta['suffix']}. Three passes over the same prompts in one "
             "engine; pass 2 drafts from pass 1's outputs, pass 3 follows clear_global().", "",
             "| pass | kind | acceptance | accepted / round | tokens / call | from global | draft ms / round | tok/s |",
             "|---|---|---|---|---|---|---|---|"]
    for name, kinds in summary.items():
        for kind, v in kinds.items():
            lines.append(f"| {name} | {kind} | {pct(v['acceptance'])} ({v['accepted']}/{v['drafted']}) | "
                         f"{num(v['accepted_per_round'])} | {num(v['tokens_per_call'])} | {pct(v['global_share'])} "
                         f"| {num(v['draft_ms_per_round'])} | {v['tok_s']:.1f} |")
    lines += ["", f"Outputs of every pass equal pass 1's: {check['outputs_equal_pass_1']}; "
                  f"pass 3's drafted / accepted / rounds equal pass 1's: {check['pass_3_figures_equal_pass_1']}"]
    return "\n".join(lines) + "\n"


def versus_ngram(engines: dict, prompts, ids: dict, new_tokens: int, reps: int) -> list[dict]:
    """One row per (repetition, prompt, run) for runs target-only, ngram, suffix, interleaved."""
    names = ["target-only", "ngram", "suffix"]
    suffix = engines["suffix"].drafter
    rows = []
    for rep in range(reps):
        suffix.clear_global()
        for i, p in enumerate(prompts):
            shift = (rep + i) % len(names)
            block = []
            for name in names[shift:] + names[:shift]:
                engine = engines["ngram" if name == "ngram" else "suffix"]
                res = engine.generate_ids(ids[p.id], new_tokens, target_only=name == "target-only", stop=[])
                s = res.stats
                block.append({"rep": rep, "prompt": p.id, "kind": p.kind, "run": name, "tokens": list(res.token_ids),
                              "tok_s": len(res.token_ids) / s.total_s, "drafted": s.drafted, "accepted": s.accepted})
            reference = next(r["tokens"] for r in block if r["run"] == "target-only")
            for r in block:
                r["lossless"] = r.pop("tokens") == reference
            rows += block
            print(f"rep {rep} {p.id}: " + ", ".join(f"{r['run']} {r['tok_s']:.1f} tok/s" for r in block),
                  file=sys.stderr)
    return rows


def summarize_versus(rows: list[dict]) -> dict:
    """Per kind (and all): each drafter's speedup over the target-only run of the same prompt and
    repetition, suffix over ngram (geometric means of per-prompt ratios), acceptance, lossless count."""
    geo = lambda xs: math.exp(statistics.fmean(math.log(x) for x in xs))  # noqa: E731
    tok = {(r["rep"], r["prompt"], r["run"]): r for r in rows}
    out = {}
    for kind in sorted({r["kind"] for r in rows}) + ["all"]:
        keys = sorted({(r["rep"], r["prompt"]) for r in rows if kind in ("all", r["kind"])})
        entry = {}
        for name in ("ngram", "suffix"):
            mine = [tok[(*key, name)] for key in keys]
            drafted = sum(r["drafted"] for r in mine)
            entry[name] = {"speedup": geo([tok[(*key, name)]["tok_s"] / tok[(*key, "target-only")]["tok_s"]
                                           for key in keys]),
                           "acceptance": sum(r["accepted"] for r in mine) / drafted if drafted else None,
                           "lossless": f"{sum(r['lossless'] for r in mine)}/{len(mine)}"}
        entry["suffix/ngram"] = geo([tok[(*key, "suffix")]["tok_s"] / tok[(*key, "ngram")]["tok_s"] for key in keys])
        entry["prompts"] = len(keys)
        out[kind] = entry
    return out


def versus_markdown(summary: dict, meta: dict) -> str:
    pct = lambda v: "-" if v is None else f"{v:.0%}"  # noqa: E731
    lines = [f"Suffix vs n-gram drafts on {meta['target']}: {meta['prompts']} prompts x {meta['reps']} repetitions x "
             f"{meta['max_new_tokens']} new tokens (EOS {meta['eos']}), k={meta['k']}, {meta['suffix']}; "
             "target-only, n-gram and suffix runs of each prompt back to back. Speedup: geometric mean of tok/s "
             "over the same prompt's target-only tok/s; suffix / ngram: of suffix tok/s over n-gram tok/s.", "",
             "| kind | ngram speedup | suffix speedup | suffix / ngram | ngram acceptance | suffix acceptance "
             "| = target-only |", "|---|---|---|---|---|---|---|"]
    for kind, v in summary.items():
        n, x = v["ngram"], v["suffix"]
        lines.append(f"| {kind} | {n['speedup']:.2f}x | {x['speedup']:.2f}x | {v['suffix/ngram']:.2f} | "
                     f"{pct(n['acceptance'])} | {pct(x['acceptance'])} | ngram {n['lossless']}, "
                     f"suffix {x['lossless']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=None, help="YAML of the target (default: the packaged cpu.yaml); "
                                                   "its drafter is replaced by kind: suffix")
    ap.add_argument("--prompts", default=None, help="JSONL of {id, kind, prompt} (default: the packaged set)")
    ap.add_argument("--kinds", default=None, help="comma-separated prompt kinds (default: all)")
    ap.add_argument("--k", default=None, help="draft length (1..16), or auto (the adaptive policy); default: 8 "
                                               "for the passes, the config's for --versus-ngram")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--eos", choices=("stop", "ignore"), default="stop",
                    help="stop at EOS (default), or ignore it so every run makes --max-new-tokens")
    ap.add_argument("--suffix-max-depth", type=int, default=None)
    ap.add_argument("--suffix-factor", type=float, default=None)
    ap.add_argument("--suffix-min-prob", type=float, default=None)
    ap.add_argument("--json", default=None, help="also write the figures and every row to this file")
    ap.add_argument("--versus-ngram", action="store_true",
                    help="instead of the passes: target-only, n-gram and suffix runs of each prompt side by side")
    ap.add_argument("--reps", type=int, default=1, help="--versus-ngram: repetitions of every prompt")
    args = ap.parse_args(argv)
    if args.max_new_tokens < 1 or args.reps < 1:
        ap.error("--max-new-tokens and --reps must be >= 1")
    k = args.k if args.k in (None, "auto") else int(args.k)
    if k is None and not args.versus_ngram:
        k = 8
    overrides = {"drafter.kind": "suffix", "drafter.k": k,
                 "drafter.suffix_max_depth": args.suffix_max_depth, "drafter.suffix_factor": args.suffix_factor,
                 "drafter.suffix_min_prob": args.suffix_min_prob}
    if isinstance(k, int):
        overrides["drafter.k_max"] = k
    cfg = load_config(args.config, overrides)
    if cfg.drafter.process != "inproc":
        ap.error("the suffix drafter must run in this process (drafter.process: inproc) to clear its global tree")
    t = cfg.target
    print(f"loading {t.model} on {t.backend}:{t.device}:{t.precision} with the suffix drafter ...", file=sys.stderr)
    engine = Engine.from_config(cfg, progress=True)
    drafter = engine.drafter
    if not hasattr(drafter, "clear_global"):
        ap.error(f"the configured drafter is {drafter.name}, not the suffix drafter")
    if isinstance(k, int):
        engine.policy = FixedDraftLength(k)
    prompts = load_prompts(args.prompts, args.kinds.split(",") if args.kinds else None)
    ids = {p.id: engine.encode(p.prompt) for p in prompts}
    suffix = (f"suffix_max_depth={cfg.drafter.suffix_max_depth}, suffix_factor={cfg.drafter.suffix_factor}, "
              f"suffix_min_prob={cfg.drafter.suffix_min_prob}")
    meta = {"target": f"{Path(str(t.model)).name}@{t.backend}:{t.device}:{t.precision}", "prompts": len(prompts),
            "max_new_tokens": args.max_new_tokens, "eos": args.eos, "k": cfg.drafter.k, "suffix": suffix}
    if args.versus_ngram:
        ngram_overrides = {"drafter.kind": "ngram", "drafter.k": k, "drafter.k_max": overrides.get("drafter.k_max")}
        print("loading the target again with the n-gram drafter ...", file=sys.stderr)
        engines = {"suffix": engine, "ngram": Engine.from_config(load_config(args.config, ngram_overrides))}
        if isinstance(k, int):
            engines["ngram"].policy = FixedDraftLength(k)
        for e in engines.values():
            if args.eos == "ignore":
                e.eos_ids = set()
            for target_only in (True, False):  # warm-up, not counted
                e.generate_ids(e.encode(WARMUP_PROMPT), min(16, args.max_new_tokens), target_only=target_only,
                               stop=[])
        rows = versus_ngram(engines, prompts, ids, args.max_new_tokens, args.reps)
        summary = summarize_versus(rows)
        md = versus_markdown(summary, meta | {"reps": args.reps})
        print(md)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({"meta": meta | {"reps": args.reps}, "summary": summary,
                                                   "rows": rows}, indent=1))
        for e in engines.values():
            e.close()
        return 0
    if args.eos == "ignore":
        engine.eos_ids = set()
    counter = SourceCounter(drafter)
    engine.generate_ids(engine.encode(WARMUP_PROMPT), min(16, args.max_new_tokens), stop=[])
    drafter.clear_global()  # the warm-up's output must not help pass 1
    counter.take()
    counter.first_s, counter.call_s = [], []
    passes = {}
    for name in PASSES:
        if name.startswith("pass 3"):
            drafter.clear_global()
        t0 = time.perf_counter()
        passes[name] = run_pass(engine, prompts, ids, args.max_new_tokens, counter)
        print(f"{name}: {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    summary, check = summarize(passes), checks(passes)
    cost = counter.costs()
    md = to_markdown(summary, meta, check)
    if cost:
        md += (f"Drafting time per call after a request's first: mean {cost['mean_ms']:.3f} ms, p99 "
               f"{cost['p99_ms']:.3f} ms, max {cost['max_ms']:.3f} ms over {cost['calls']} calls (contexts of "
               f"{cost['context_mean']:.0f} tokens on average, {cost['context_max']} at most); a request's first "
               f"call, which indexes the prompt: {cost['first_call_mean_ms']:.2f} ms on average.\n")
    print(md)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"meta": meta, "summary": summary, "checks": check,
                                               "draft_cost": cost, "passes": passes}, indent=1))
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
