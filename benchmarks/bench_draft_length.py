"""Adaptive draft length against every fixed k, per prompt kind, in one run.

    python benchmarks/bench_draft_length.py [--target onnxruntime:cpu:int4] [--drafter ngram]
                                            [--ks 1,2,3,4,5,6,8] [--reps 2] [--max-new-tokens 128]
                                            [--kinds grounded,open] [--out bench-results/draft-length]

One engine is loaded (the target, and the drafter with `k: auto`); only its
draft-length policy is swapped between runs. For every prompt and repetition
the target-only run and every policy run back to back, in an order that
rotates, so each speedup is a ratio of runs made seconds apart on the same
loaded model: this 2-core machine's speed drifts 10-20% over minutes, which
separate `hetero-sd bench` configurations (each with its own load and its own
paired baseline) cannot cancel. The adaptive policy is the one the config
builds and keeps its learnt costs across prompts, as it does in use; each
policy gets one warm-up generation first.

Speedup per kind: geometric mean over prompts and repetitions of the policy's
tok/s over the target-only tok/s of the same prompt and repetition. Every run's
output ids are checked against target-only (lossless). Writes
`draft-length.{json,md}` to --out. Not a test: speed is measured, never asserted.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from tqdm import tqdm

from hetero_sd.bench.common import WARMUP_PROMPT
from hetero_sd.bench.prompts import load_prompts
from hetero_sd.engine import Engine
from hetero_sd.config import load_config
from hetero_sd.scheduler.draft_length import FixedDraftLength


def _config(target: str, drafter: str, k_max: int) -> dict:
    backend, device, precision = target.split(":")
    if drafter == "ngram":
        d = {"kind": "ngram"}
    else:
        _, d_backend, d_device, d_precision = drafter.split(":")
        d = {"kind": "model", "backend": d_backend, "device": d_device, "precision": d_precision}
    return {"target": {"model": "default", "backend": backend, "device": device, "precision": precision},
            "drafter": {**d, "k": "auto", "k_max": k_max}}


def _geomean(xs: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(x) for x in xs))


def measure(engine, policies: dict, prompts, ids: dict, reps: int, new_tokens: int) -> list[dict]:
    """One row per (repetition, prompt, run): tok/s, drafted, accepted, lossless."""
    names = ["target-only", *policies]
    for name, policy in policies.items():  # warm-up: kernels, caches, the adaptive costs' first timings
        engine.policy = policy
        engine.generate_ids(ids[WARMUP_PROMPT], min(16, new_tokens), stop=[])
    rows, bar = [], tqdm(total=reps * len(prompts) * len(names), desc="draft length", unit="run", file=sys.stderr)
    for rep in range(reps):
        for i, p in enumerate(prompts):
            shift = (rep + i) % len(names)
            for name in names[shift:] + names[:shift]:
                target_only = name == "target-only"
                if not target_only:
                    engine.policy = policies[name]
                res = engine.generate_ids(ids[p.id], new_tokens, target_only=target_only, stop=[])
                s = res.stats
                rows.append({"rep": rep, "prompt": p.id, "kind": p.kind, "run": name,
                             "tokens": list(res.token_ids), "tok_s": len(res.token_ids) / s.total_s,
                             "drafted": s.drafted, "accepted": s.accepted})
                bar.update()
            reference = next(r["tokens"] for r in rows[-len(names):] if r["run"] == "target-only")
            for r in rows[-len(names):]:
                r["lossless"] = r.pop("tokens") == reference
    bar.close()
    return rows


def summarize(rows: list[dict], names: list[str]) -> dict:
    """Per kind (and all) and run: speedup over the paired target-only, tok/s, acceptance."""
    base = {(r["rep"], r["prompt"]): r["tok_s"] for r in rows if r["run"] == "target-only"}
    out = {}
    for kind in sorted({r["kind"] for r in rows}) + ["all"]:
        for name in names:
            mine = [r for r in rows if r["run"] == name and kind in ("all", r["kind"])]
            ratios = [r["tok_s"] / base[(r["rep"], r["prompt"])] for r in mine]
            drafted = sum(r["drafted"] for r in mine)
            out.setdefault(kind, {})[name] = {
                "speedup": _geomean(ratios), "tok_s": _geomean([r["tok_s"] for r in mine]),
                "acceptance": sum(r["accepted"] for r in mine) / drafted if drafted else None,
                "lossless": f"{sum(r['lossless'] for r in mine)}/{len(mine)}"}
    return out


def auto_vs_best(rows: list[dict], summary: dict, resamples: int = 2000) -> dict:
    """Per kind: auto's tok/s over the best fixed k's, run by run (same prompt and
    repetition), as a geometric mean with a bootstrap 95% interval over those
    pairs. The best k is picked on the same runs, which favours it: the
    maximum of several noisy figures is biased upward."""
    import random

    rng, out = random.Random(0), {}
    for kind, runs in summary.items():
        fixed = {n: v["speedup"] for n, v in runs.items() if n.startswith("k=")}
        if not fixed or "auto" not in runs:
            continue
        best = max(fixed, key=fixed.get)
        by_block: dict = {}
        for r in rows:
            if kind in ("all", r["kind"]) and r["run"] in (best, "auto"):
                by_block.setdefault((r["rep"], r["prompt"]), {})[r["run"]] = r["tok_s"]
        logs = [math.log(v["auto"] / v[best]) for v in by_block.values()]
        means = sorted(statistics.fmean(rng.choices(logs, k=len(logs))) for _ in range(resamples))
        out[kind] = {"best": best, "ratio": math.exp(statistics.fmean(logs)),
                     "low": math.exp(means[int(0.025 * resamples)]), "high": math.exp(means[int(0.975 * resamples)]),
                     "held_out": _held_out(rows, kind)}
    return out


def _held_out(rows: list[dict], kind: str) -> float | None:
    """auto / the fixed k that was best on the other repetitions, on each
    repetition in turn (geometric mean): the best k as a user would know it
    from earlier runs, free of the bias of picking it on the runs it is
    judged on. None with a single repetition."""
    mine = [r for r in rows if kind in ("all", r["kind"])]
    reps = sorted({r["rep"] for r in mine})
    if len(reps) < 2:
        return None
    logs = []
    for rep in reps:
        train = [r for r in mine if r["rep"] != rep]
        base = {(r["rep"], r["prompt"]): r["tok_s"] for r in train if r["run"] == "target-only"}
        fixed = {r["run"] for r in train if r["run"].startswith("k=")}
        best = max(fixed, key=lambda n: statistics.fmean(
            math.log(r["tok_s"] / base[(r["rep"], r["prompt"])]) for r in train if r["run"] == n))
        test = {}
        for r in mine:
            if r["rep"] == rep and r["run"] in (best, "auto"):
                test.setdefault(r["prompt"], {})[r["run"]] = r["tok_s"]
        logs += [math.log(v["auto"] / v[best]) for v in test.values()]
    return math.exp(statistics.fmean(logs))


def to_markdown(summary: dict, meta: dict, versus: dict) -> str:
    lines = [f"Draft length on {meta['target']} with the {meta['drafter']} drafter: {meta['prompts']} prompts x "
             f"{meta['reps']} repetitions x {meta['max_new_tokens']} new tokens (EOS ignored, greedy). Speedup: "
             "geometric mean of tok/s over the target-only tok/s of the same prompt and repetition, run back "
             "to back on one loaded engine. Best fixed k per kind in bold; auto / best: the adaptive "
             "policy's tok/s over that best k's, run by run, geometric mean [bootstrap 95% interval]; picking the "
             "best on the same runs favours it, so the next line picks it on the other repetitions.", "",
             "| kind | run | speedup | tok/s | acceptance | = target-only |", "|---|---|---|---|---|---|"]
    for kind, runs in summary.items():
        vs = versus.get(kind)
        for name, v in runs.items():
            label = f"**{name}**" if vs and name == vs["best"] else name
            acc = "-" if v["acceptance"] is None else f"{v['acceptance']:.0%}"
            lines.append(f"| {kind} | {label} | {v['speedup']:.3f}x | {v['tok_s']:.1f} | {acc} | {v['lossless']} |")
        if vs:
            lines.append(f"| {kind} | auto / best ({vs['best']}) | {vs['ratio']:.3f} [{vs['low']:.3f}, "
                         f"{vs['high']:.3f}] | | | |")
            if vs["held_out"] is not None:
                lines.append(f"| {kind} | auto / best k of the other repetitions | {vs['held_out']:.3f} | | | |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="onnxruntime:cpu:int4", help="backend:device:precision of the target")
    ap.add_argument("--drafter", default="ngram", help="ngram, or model:backend:device:precision")
    ap.add_argument("--ks", default="1,2,3,4,5,6,8", help="fixed draft lengths to compare with k: auto")
    ap.add_argument("--k-max", type=int, default=8, help="the adaptive policy's bound")
    ap.add_argument("--reps", type=int, default=2, help="repetitions of every prompt")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--kinds", default=None, help="comma-separated prompt kinds (default: all)")
    ap.add_argument("--out", default="bench-results/draft-length")
    args = ap.parse_args(argv)
    ks = [int(k) for k in args.ks.split(",") if k.strip()]
    if args.reps < 1 or args.max_new_tokens < 2 or not all(1 <= k <= args.k_max for k in ks):
        ap.error("need --reps >= 1, --max-new-tokens >= 2 and every k in 1..--k-max")
    cfg = load_config(None, _config(args.target, args.drafter, args.k_max))
    print(f"loading {args.target} with the {args.drafter} drafter ...", file=sys.stderr)
    engine = Engine.from_config(cfg, progress=True)
    engine.eos_ids = set()  # EOS ignored: every run makes exactly --max-new-tokens
    prompts = load_prompts(None, args.kinds.split(",") if args.kinds else None)
    ids = {p.id: engine.encode(p.prompt) for p in prompts} | {WARMUP_PROMPT: engine.encode(WARMUP_PROMPT)}
    policies = {f"k={k}": FixedDraftLength(k) for k in ks} | {"auto": engine.policy}
    rows = measure(engine, policies, prompts, ids, args.reps, args.max_new_tokens)
    meta = {"target": args.target, "drafter": args.drafter, "ks": ks, "k_max": args.k_max, "reps": args.reps,
            "max_new_tokens": args.max_new_tokens, "prompts": len(prompts)}
    summary = summarize(rows, ["target-only", *policies])
    versus = auto_vs_best(rows, summary)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "draft-length.json").write_text(json.dumps({"meta": meta, "summary": summary, "auto_vs_best": versus,
                                                       "rows": rows}, indent=1))
    md = to_markdown(summary, meta, versus)
    (out / "draft-length.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
