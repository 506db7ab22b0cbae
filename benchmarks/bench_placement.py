"""`placement: auto` against trying the placements by hand, in one run.

    python benchmarks/bench_placement.py [--max-new-tokens 64] [--prompts-per-kind 2]
                                         [--draft-placements 3] [--json out.json]

1. Builds configs/auto.yaml (profiling this host on the first run, cached
   after) and records what the splitter chose.
2. Measures, on the same prompts, every exact target placement with no
   drafter and with the n-gram drafter, and with the draft model (the same
   GGUF) on the `--draft-placements` cheapest draft placements of the
   profile; every one with `k: auto`, as the automatic configuration uses.
3. Reports measured tokens/s (prefill included, summed over the prompts) of
   each, and the automatic choice's as a fraction of the best measured.
Not a test: speed is measured, never asserted.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time

from hetero_sd.bench.prompts import load_prompts
from hetero_sd.engine import Engine
from hetero_sd.config import PACKAGED, load_config


def _measure(engine, prompts, max_new) -> tuple[float, int]:
    engine.generate(prompts[0]["prompt"], max_new_tokens=8)  # warm-up, not counted
    tokens, seconds = 0, 0.0
    for p in prompts:
        t0 = time.perf_counter()
        res = engine.generate(p["prompt"], max_new_tokens=max_new)
        seconds += time.perf_counter() - t0
        tokens += len(res.token_ids)
    return tokens / seconds, tokens


def _candidates(plan, n_draft: int) -> list[dict]:
    targets = sorted({c.target for c in plan.ranked if c.drafter == "none"}, key=str)
    draft_costs = {d.profile.placement: d.profile.decode_s for d in plan.problem.drafters if d.kind == "model"}
    cheapest = sorted(draft_costs, key=draft_costs.get)[:n_draft]
    out = []
    for t in targets:
        place = {"backend": t.backend, "device": t.device, "precision": t.precision}
        out.append({"target": place, "drafter": {"kind": "none"}})
        out.append({"target": place, "drafter": {"kind": "ngram", "k": "auto"}})
        for d in cheapest:
            out.append({"target": place, "drafter": {"kind": "model", "k": "auto", "backend": d.backend,
                                                     "device": d.device, "precision": d.precision}})
    return out


def _label(cand: dict) -> str:
    t, d = cand["target"], cand["drafter"]
    drafter = d["kind"] if d["kind"] != "model" else f"model@{d['backend']}:{d['device']}/{d['precision']}"
    return f"{t['backend']}:{t['device']}/{t['precision']} + {drafter}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompts-per-kind", type=int, default=2)
    ap.add_argument("--draft-placements", type=int, default=3)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    prompts = load_prompts(None)
    chosen = []
    for kind in sorted({p.kind for p in prompts}):
        chosen += [{"prompt": p.prompt, "kind": kind} for p in prompts if p.kind == kind][:args.prompts_per_kind]
    auto_cfg = load_config(PACKAGED / "auto.yaml")
    print("building configs/auto.yaml (the first run on a host profiles every placement) ...", file=sys.stderr)
    engine = Engine.from_config(auto_cfg, progress=True)
    plan = engine.plan
    print(plan.explain(), file=sys.stderr)
    rows = [{"config": f"auto -> {plan.best.target} + {plan.best.drafter_label}", "auto": True}]
    rows[0]["tok_s"], rows[0]["tokens"] = _measure(engine, chosen, args.max_new_tokens)
    del engine
    gc.collect()
    for cand in _candidates(plan, args.draft_placements):
        label = _label(cand)
        try:
            cfg = load_config(PACKAGED / "cpu.yaml", {
                "target.backend": cand["target"]["backend"], "target.device": cand["target"]["device"],
                "target.precision": cand["target"]["precision"],
                **{f"drafter.{k}": v for k, v in cand["drafter"].items()}})
            engine = Engine.from_config(cfg)
            tok_s, tokens = _measure(engine, chosen, args.max_new_tokens)
        except Exception as exc:
            print(f"{label}: skipped ({type(exc).__name__}: {exc})", file=sys.stderr)
            continue
        finally:
            engine = None
            gc.collect()
        rows.append({"config": label, "auto": False, "tok_s": tok_s, "tokens": tokens})
        print(f"{label}: {tok_s:.1f} tok/s", file=sys.stderr)
    best = max((r for r in rows if not r["auto"]), key=lambda r: r["tok_s"])
    ratio = rows[0]["tok_s"] / best["tok_s"]
    print(f"\n{len(chosen)} prompts x {args.max_new_tokens} tokens; tokens/s includes prefill\n")
    print("| configuration | tok/s | vs best by hand |\n|---|---|---|")
    for r in sorted(rows, key=lambda r: -r["tok_s"]):
        print(f"| {r['config']}{' (auto)' if r['auto'] else ''} | {r['tok_s']:.1f} | {r['tok_s'] / best['tok_s']:.2f}x |")
    print(f"\nauto / best by hand = {ratio:.2f} (best: {best['config']})")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": rows, "auto_vs_best": ratio, "explain": plan.explain()}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
