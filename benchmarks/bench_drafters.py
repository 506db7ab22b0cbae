"""Model-free and head drafters side by side, per prompt kind, in one run (issue 14).

    python benchmarks/bench_drafters.py [--config configs/cpu.yaml] [--drafters ngram,suffix,head,hybrid]
                                        [--k 4] [--reps 1] [--max-new-tokens 128] [--out bench-results/drafters]

One target is loaded (the config's, with the head's feature layers when a head
drafter is asked for); each drafter is built on it. For every prompt and
repetition the target-only run and every drafter's run go back to back, in an
order that rotates, so each speedup is a ratio of runs made seconds apart on
this drifting 2-core host. Two passes per drafter:
- acceptance at a fixed k (--k): the rate per draft position 1..k and the
  mean accepted length per round, per kind (positions comparable across drafters);
- speed with k: auto (the config's k_max): tok/s over the target-only run of
  the same prompt, geometric mean per kind.
The draft cost per drafted token is reported as a fraction of the target's
one-token decode (target-only decode seconds per token, same run). Every
output is checked against target-only (lossless). Suffix drafters keep their
global tree across prompts, as in use. Not a test: speed is measured, never asserted.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from pathlib import Path

from hetero_sd.bench.common import WARMUP_PROMPT
from hetero_sd.bench.prompts import load_prompts
from hetero_sd.build import build
from hetero_sd.config import load_config
from hetero_sd.drafting.build import build_drafter
from hetero_sd.engine import Engine
from hetero_sd.loading import Loader
from hetero_sd.scheduler import AdaptiveDraftLength, FixedDraftLength
from hetero_sd.spec import spec_from_config


def _geomean(xs: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(x) for x in xs)) if xs else float("nan")


def engines(config: str, kinds: list[str], k_max: int, head: str) -> tuple[Engine, dict]:
    """One target (with features if any drafter needs them) and one engine per drafter kind."""
    load = Loader()
    specs = {kind: spec_from_config(load_config(config, {"drafter.kind": kind, **(
        {"drafter.head": head} if kind in ("head", "hybrid") else {})})) for kind in kinds}
    target_spec = max((s.target for s in specs.values()), key=lambda t: len(t.features))
    built = build(dataclasses.replace(specs[kinds[0]], target=target_spec, drafter=None), load)
    vocab = load.ir(target_spec.model).config.vocab_size
    out = {}
    for kind, spec in specs.items():
        out[kind] = Engine(built.target, build_drafter(spec.drafter, vocab, load), tokenizer=built.tokenizer,
                           eos_ids=built.eos_ids, chat_template=True, policy=AdaptiveDraftLength(k_max))
    base = Engine(built.target, None, tokenizer=built.tokenizer, eos_ids=built.eos_ids, chat_template=True)
    return base, out


def _clear_global(engine: Engine) -> None:
    """Forget earlier requests' outputs (suffix trees), so a pass never drafts a prompt's own earlier output."""
    drafter = engine.drafter
    for d in (drafter, getattr(drafter, "suffix", None)):
        if hasattr(d, "clear_global"):
            d.clear_global()


def run(base: Engine, engines_: dict, prompts, ids: dict, reps: int, new: int, k: int) -> list[dict]:
    """Two passes over the prompts (fixed k, then k: auto), each starting with empty suffix
    trees; per prompt, target-only then every drafter in a rotating order."""
    rows, names = [], list(engines_)
    for eng in [base, *engines_.values()]:  # warm-up
        eng.generate_ids(ids[WARMUP_PROMPT], 16, stop=[])
    for rep in range(reps):
        for mode in ("fixed", "auto"):
            for eng in engines_.values():
                _clear_global(eng)
            for i, p in enumerate(prompts):
                ref = base.generate_ids(ids[p.id], new, stop=[])
                decode_s = (ref.stats.total_s - ref.stats.prefill_s) / max(1, len(ref.token_ids) - 1)
                rows.append({"rep": rep, "mode": mode, "prompt": p.id, "kind": p.kind, "run": "target-only",
                             "tok_s": len(ref.token_ids) / ref.stats.total_s, "decode_s": decode_s})
                for name in names[(i + rep) % len(names):] + names[:(i + rep) % len(names)]:
                    eng = engines_[name]
                    keep = eng.policy
                    if mode == "fixed":
                        eng.policy = FixedDraftLength(k)
                    res = eng.generate_ids(ids[p.id], new, stop=[])
                    eng.policy = keep
                    s = res.stats
                    rows.append({"rep": rep, "mode": mode, "prompt": p.id, "kind": p.kind, "run": f"{name}@{mode}",
                                 "tok_s": len(res.token_ids) / s.total_s, "drafted": s.drafted,
                                 "accepted": s.accepted, "rounds": s.rounds, "draft_s": s.draft_s,
                                 "drafted_pos": list(s.drafted_pos), "accepted_pos": list(s.accepted_pos),
                                 "lossless": res.token_ids == ref.token_ids})
    return rows


def summarise(rows: list[dict], names: list[str], k: int) -> dict:
    out = {}
    base = {(r["rep"], r["mode"], r["prompt"]): r for r in rows if r["run"] == "target-only"}
    for kind in sorted({r["kind"] for r in rows}):
        decode = statistics.median(r["decode_s"] for r in base.values() if r["kind"] == kind)
        for name in names:
            fixed = [r for r in rows if r["run"] == f"{name}@fixed" and r["kind"] == kind]
            auto = [r for r in rows if r["run"] == f"{name}@auto" and r["kind"] == kind]
            dpos = [sum(r["drafted_pos"][j] for r in fixed if j < len(r["drafted_pos"])) for j in range(k)]
            apos = [sum(r["accepted_pos"][j] for r in fixed if j < len(r["accepted_pos"])) for j in range(k)]
            rounds = sum(r["rounds"] for r in fixed)
            drafted = sum(r["drafted"] for r in fixed)
            out[f"{kind}/{name}"] = {
                "speedup_auto": round(_geomean([r["tok_s"] / base[(r["rep"], r["mode"], r["prompt"])]["tok_s"] for r in auto]), 3),
                "speedup_fixed_k": round(_geomean([r["tok_s"] / base[(r["rep"], r["mode"], r["prompt"])]["tok_s"]
                                                   for r in fixed]), 3),
                "acceptance_per_position": [round(a / d, 3) if d else None for a, d in zip(apos, dpos)],
                "mean_accepted_per_round": round(sum(r["accepted"] for r in fixed) / max(1, rounds), 3),
                "draft_cost_per_token_vs_decode": round(sum(r["draft_s"] for r in fixed) / max(1, drafted) / decode, 3),
                "lossless": all(r["lossless"] for r in fixed + auto)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=None, help="YAML whose target and drafter keys are used (default: cpu.yaml)")
    ap.add_argument("--drafters", default="ngram,suffix,head,hybrid")
    ap.add_argument("--head", default="auto", help="the head folder for head and hybrid (default: auto)")
    ap.add_argument("--k", type=int, default=4, help="fixed k for the per-position acceptance pass")
    ap.add_argument("--k-max", type=int, default=8)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompts", default="default")
    ap.add_argument("--kinds", default=None, help="comma list of prompt kinds to keep (default: all)")
    ap.add_argument("--out", default="bench-results/drafters")
    args = ap.parse_args(argv)
    names = [d.strip() for d in args.drafters.split(",") if d.strip()]
    base, engs = engines(args.config, names, args.k_max, args.head)
    prompts = load_prompts(args.prompts, args.kinds.split(",") if args.kinds else None)
    ids = {p.id: base.encode(p.prompt) for p in prompts}
    ids[WARMUP_PROMPT] = base.encode(WARMUP_PROMPT)
    rows = run(base, engs, prompts, ids, args.reps, args.max_new_tokens, args.k)
    summary = summarise(rows, names, args.k)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "drafters.json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    for key, val in summary.items():
        print(key, json.dumps(val), file=sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
