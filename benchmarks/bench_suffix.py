"""Suffix decoding across requests: what earlier outputs add, in one process.

    python benchmarks/bench_suffix.py [--config configs/cpu.yaml] [--prompts PATH] [--kinds grounded,open]
                                      [--k 8] [--max-new-tokens 128] [--eos stop] [--suffix-factor 1.0]
                                      [--suffix-min-prob 0.1] [--suffix-max-depth 24] [--json OUT.json]

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
speculative round, tokens per target call (accepted + the bonus), the share of
drafted tokens that came from the global tree, and tok/s (a loaded host's
tok/s drift; compare passes, not hosts). Every pass's outputs are checked
equal to pass 1's (greedy output does not depend on drafts). Not a test:
nothing is asserted about speed.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from hetero_sd.bench.common import WARMUP_PROMPT
from hetero_sd.bench.prompts import load_prompts
from hetero_sd.config import load_config
from hetero_sd.engine import build_engine
from hetero_sd.scheduler.draft_length import FixedDraftLength

PASSES = ("pass 1", "pass 2", "pass 3 (after clear_global)")


class SourceCounter:
    """Wraps the suffix drafter's draft(): drafted tokens per source (local / global)."""

    def __init__(self, drafter):
        self.drafter, self.inner = drafter, drafter.draft
        self.tokens = {"local": 0, "global": 0}
        drafter.draft = self  # an instance attribute: the engine calls this

    def __call__(self, req):
        result = self.inner(req)
        if result.tokens:
            self.tokens[self.drafter.source] += len(result.tokens[:req.k])
        return result

    def take(self) -> dict:
        out, self.tokens = self.tokens, {"local": 0, "global": 0}
        return out


def run_pass(engine, prompts, ids: dict, new_tokens: int, counter: SourceCounter) -> list[dict]:
    rows = []
    for p in prompts:
        res = engine.generate_ids(ids[p.id], new_tokens, stop=[])
        s = res.stats
        rows.append({"prompt": p.id, "kind": p.kind, "tokens": list(res.token_ids), "new": len(res.token_ids),
                     "rounds": s.rounds, "drafted": s.drafted, "accepted": s.accepted, "total_s": s.total_s,
                     "from": counter.take()})
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
                "rounds": rounds}
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
             "| pass | kind | acceptance | accepted / round | tokens / call | from global | tok/s |",
             "|---|---|---|---|---|---|---|"]
    for name, kinds in summary.items():
        for kind, v in kinds.items():
            lines.append(f"| {name} | {kind} | {pct(v['acceptance'])} ({v['accepted']}/{v['drafted']}) | "
                         f"{num(v['accepted_per_round'])} | {num(v['tokens_per_call'])} | {pct(v['global_share'])} "
                         f"| {v['tok_s']:.1f} |")
    lines += ["", f"Outputs of every pass equal pass 1's: {check['outputs_equal_pass_1']}; "
                  f"pass 3's drafted / accepted / rounds equal pass 1's: {check['pass_3_figures_equal_pass_1']}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=None, help="YAML of the target (default: the packaged cpu.yaml); "
                                                   "its drafter is replaced by kind: suffix")
    ap.add_argument("--prompts", default=None, help="JSONL of {id, kind, prompt} (default: the packaged set)")
    ap.add_argument("--kinds", default=None, help="comma-separated prompt kinds (default: all)")
    ap.add_argument("--k", default="8", help="draft length (1..16), or auto (the adaptive policy)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--eos", choices=("stop", "ignore"), default="stop",
                    help="stop at EOS (default), or ignore it so every run makes --max-new-tokens")
    ap.add_argument("--suffix-max-depth", type=int, default=None)
    ap.add_argument("--suffix-factor", type=float, default=None)
    ap.add_argument("--suffix-min-prob", type=float, default=None)
    ap.add_argument("--json", default=None, help="also write the figures and every row to this file")
    args = ap.parse_args(argv)
    if args.max_new_tokens < 1:
        ap.error("--max-new-tokens must be >= 1")
    k = args.k if args.k == "auto" else int(args.k)
    overrides = {"drafter.kind": "suffix", "drafter.k": k,
                 "drafter.suffix_max_depth": args.suffix_max_depth, "drafter.suffix_factor": args.suffix_factor,
                 "drafter.suffix_min_prob": args.suffix_min_prob}
    if k != "auto":
        overrides["drafter.k_max"] = max(k, 1)
    cfg = load_config(args.config, overrides)
    if cfg.drafter.process != "inproc":
        ap.error("the suffix drafter must run in this process (drafter.process: inproc) to clear its global tree")
    t = cfg.target
    print(f"loading {t.model} on {t.backend}:{t.device}:{t.precision} with the suffix drafter ...", file=sys.stderr)
    engine = build_engine(cfg, progress=True)
    drafter = engine.drafter
    if not hasattr(drafter, "clear_global"):
        ap.error(f"the configured drafter is {drafter.name}, not the suffix drafter")
    if k != "auto":
        engine.policy = FixedDraftLength(k)
    if args.eos == "ignore":
        engine.eos_ids = set()
    prompts = load_prompts(args.prompts, args.kinds.split(",") if args.kinds else None)
    ids = {p.id: engine.encode(p.prompt) for p in prompts}
    counter = SourceCounter(drafter)
    engine.generate_ids(engine.encode(WARMUP_PROMPT), min(16, args.max_new_tokens), stop=[])
    drafter.clear_global()  # the warm-up's output must not help pass 1
    counter.take()
    passes = {}
    for name in PASSES:
        if name.startswith("pass 3"):
            drafter.clear_global()
        t0 = time.perf_counter()
        passes[name] = run_pass(engine, prompts, ids, args.max_new_tokens, counter)
        print(f"{name}: {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    summary, check = summarize(passes), checks(passes)
    suffix = (f"suffix_max_depth={cfg.drafter.suffix_max_depth}, suffix_factor={cfg.drafter.suffix_factor}, "
              f"suffix_min_prob={cfg.drafter.suffix_min_prob}")
    meta = {"target": f"{Path(str(t.model)).name}@{t.backend}:{t.device}:{t.precision}", "prompts": len(prompts),
            "max_new_tokens": args.max_new_tokens, "eos": args.eos, "k": k, "suffix": suffix}
    md = to_markdown(summary, meta, check)
    print(md)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"meta": meta, "summary": summary, "checks": check,
                                               "passes": passes}, indent=1))
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
