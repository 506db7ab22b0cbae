"""Our target-only decoding against OpenVINO GenAI's plain greedy at its exact
settings, interleaved prompt by prompt.

    python benchmarks/bench_vs_genai.py [--targets openvino:CPU:int4,onnxruntime:cpu:int4]
                                        [--reps 2] [--max-new-tokens 128] [--kinds grounded,open]

Every engine and one GenAI `LLMPipeline` (exact f32 hints, prefix caching off,
the same token ids) are loaded first; then for each repetition and prompt
every one of them generates back to back, in a rotating order. `hetero-sd
bench` runs each configuration over all prompts before the next, minutes
apart, and this host's speed drifts 10-50% over minutes; here each ratio is
ours / GenAI on the same prompt seconds apart, reported per prompt kind as a
geometric mean with a bootstrap 95% interval, for tok/s (prefill counted) and
decode tok/s. Writes `vs-genai.{json,md}` to --out. Not a test: speed is
measured, never asserted.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from pathlib import Path

from tqdm import tqdm

from hetero_sd.bench.common import Sample
from hetero_sd.bench.genai_peer import EXACT_HINTS, _config, _generate, _import, _pipeline, _sample, genai_model
from hetero_sd.bench.ours import _sample as our_sample
from hetero_sd.bench.prompts import load_prompts
from hetero_sd.bench.runner import BenchOptions, _workload
from hetero_sd.engine import Engine
from hetero_sd.config import load_config, resolve_model

GENAI = "genai-exact plain"


def _ratios(pairs: list[tuple[float, float]], resamples: int = 2000) -> dict:
    logs = [math.log(a / b) for a, b in pairs]
    rng = random.Random(0)
    means = sorted(statistics.fmean(rng.choices(logs, k=len(logs))) for _ in range(resamples))
    return {"ratio": math.exp(statistics.fmean(logs)), "low": math.exp(means[int(0.025 * resamples)]),
            "high": math.exp(means[int(0.975 * resamples)])}


def summarize(samples: dict[str, list[tuple[int, Sample]]]) -> dict:
    """Per kind and run: geometric-mean tok/s and decode tok/s, and ours / GenAI run by run."""
    out = {}
    ref = {(rep, s.id): s for rep, s in samples[GENAI]}
    kinds = sorted({s.kind for _, s in samples[GENAI]}) + ["all"]
    for kind in kinds:
        for name, runs in samples.items():
            mine = [(rep, s) for rep, s in runs if kind in ("all", s.kind)]
            row = {"tok_s": math.exp(statistics.fmean(math.log(s.tok_s) for _, s in mine)),
                   "decode_tok_s": math.exp(statistics.fmean(math.log(s.decode_tok_s) for _, s in mine))}
            if name != GENAI:
                row["vs_genai"] = _ratios([(s.tok_s, ref[(rep, s.id)].tok_s) for rep, s in mine])
                row["decode_vs_genai"] = _ratios([(s.decode_tok_s, ref[(rep, s.id)].decode_tok_s) for rep, s in mine])
            out.setdefault(kind, {})[name] = row
    return out


def to_markdown(summary: dict, meta: dict) -> str:
    ci = lambda r: f"{r['ratio']:.3f}x [{r['low']:.3f}, {r['high']:.3f}]"  # noqa: E731
    lines = [f"Target-only greedy vs OpenVINO GenAI plain greedy with its exact hints ({meta['hints']}), "
             f"{meta['prompts']} prompts x {meta['reps']} repetitions x {meta['max_new_tokens']} new tokens, EOS "
             "ignored, every run back to back per prompt. Ratios: geometric mean of ours / GenAI on the same "
             "prompt and repetition [bootstrap 95% interval].", "",
             "| kind | run | tok/s | decode tok/s | tok/s vs GenAI | decode vs GenAI |", "|---|---|---|---|---|---|"]
    for kind, runs in summary.items():
        for name, r in runs.items():
            vs = (ci(r["vs_genai"]), ci(r["decode_vs_genai"])) if "vs_genai" in r else ("-", "-")
            lines.append(f"| {kind} | {name} | {r['tok_s']:.1f} | {r['decode_tok_s']:.1f} | {vs[0]} | {vs[1]} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--targets", default="openvino:CPU:int4,onnxruntime:cpu:int4",
                    help="comma-separated backend:device:precision target placements")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--kinds", default=None, help="comma-separated prompt kinds (default: all)")
    ap.add_argument("--out", default="bench-results/vs-genai")
    args = ap.parse_args(argv)
    if args.reps < 1 or args.max_new_tokens < 2:
        ap.error("need --reps >= 1 and --max-new-tokens >= 2")
    ov, ov_genai = _import()
    model_path = resolve_model("default", None).resolve()
    prompts = load_prompts(None, args.kinds.split(",") if args.kinds else None)
    work = _workload(model_path, prompts, BenchOptions(max_new_tokens=args.max_new_tokens))
    engines = {}
    for target in args.targets.split(","):
        backend, device, precision = target.strip().split(":")
        cfg = load_config(None, {"target": {"model": "default", "backend": backend, "device": device,
                                            "precision": precision}, "drafter": {"kind": "none"}})
        print(f"loading {target} ...", file=sys.stderr)
        engine = engines[f"ours {target.strip()}"] = Engine.from_config(cfg, progress=True)
        engine.eos_ids = set()
        engine.generate_ids(work.warmup_ids, 8, target_only=True, stop=[])
    pipe = _pipeline(ov_genai, genai_model(model_path), None, "plain", EXACT_HINTS)
    gen_cfg = _config(pipe, "plain", work, {})
    _generate(ov, pipe, gen_cfg, work.warmup_ids, 8)

    names = [*engines, GENAI]
    samples: dict[str, list[tuple[int, Sample]]] = {n: [] for n in names}
    bar = tqdm(total=args.reps * len(prompts) * len(names), desc="vs genai", unit="run", file=sys.stderr)
    for rep in range(args.reps):
        for i, p in enumerate(prompts):
            shift = (rep + i) % len(names)
            for name in names[shift:] + names[:shift]:
                ids = work.ids[p.id]
                if name == GENAI:
                    res, wall = _generate(ov, pipe, gen_cfg, ids, args.max_new_tokens)
                    samples[name].append((rep, _sample(p, ids, res, wall, work)))
                else:
                    samples[name].append((rep, our_sample(engines[name], p, ids, work, True)))
                bar.update()
    bar.close()
    meta = {"targets": list(engines), "reps": args.reps, "max_new_tokens": args.max_new_tokens,
            "prompts": len(prompts), "hints": ", ".join(f"{k}={v}" for k, v in EXACT_HINTS.items()),
            "genai": ov_genai.__version__}
    summary = summarize(samples)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = {n: [{"rep": rep, **s.to_dict()} for rep, s in runs] for n, runs in samples.items()}
    (out / "vs-genai.json").write_text(json.dumps({"meta": meta, "summary": summary, "runs": rows}, indent=1))
    md = to_markdown(summary, meta)
    (out / "vs-genai.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
