"""Target-only vs the n-gram and draft-model drafters on SmolLM2, side by side.

    python benchmarks/bench_spec.py [--prompts ../shared/bench/prompts.jsonl] [--max-new-tokens 128]

Every configuration runs on the same loaded target in one process, prompt by
prompt, so the ratios compare like with like on a noisy shared machine.
Tokens/s counts prefill; decode tok/s excludes it. Not a test: speed is
measured here, never asserted.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from hetero_sd.backends.registry import discover
from hetero_sd.builder import load_runner
from hetero_sd.config import ModelPlacement, default_model_path
from hetero_sd.drafters import ModelDrafter, NgramDrafter
from hetero_sd.engine import Engine
from hetero_sd.ir import load_model_ir

DEFAULT_PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "bench" / "prompts.jsonl"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=5, help="draft length for the n-gram drafter")
    ap.add_argument("--draft-k", type=int, default=4, help="draft length for the draft model")
    ap.add_argument("--backend", default="torch", help="target backend (torch | onnxruntime | openvino)")
    ap.add_argument("--device", default="cpu", help="target device")
    ap.add_argument("--precision", default="fp32", help="target precision")
    ap.add_argument("--draft-precision", default="bf16", help="draft model precision (same weights)")
    ap.add_argument("--no-draft-model", action="store_true", help="skip the draft-model drafter")
    ap.add_argument("--json", help="also write per-prompt results here")
    args = ap.parse_args()

    prompts = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    registry, ir = discover(), load_model_ir(default_model_path())
    place = ModelPlacement(backend=args.backend, device=args.device, precision=args.precision)
    target = load_runner(registry, place, ir, 256 << 20, "target", True)
    tok = ir.load_tokenizer()
    eos = tuple(set(ir.config.eos_token_ids) | {tok.eos_token_id})
    configs = {"target-only": None, f"ngram k={args.k}": (NgramDrafter(), args.k)}
    if not args.no_draft_model:
        draft = load_runner(registry, ModelPlacement(precision=args.draft_precision), ir, 256 << 20,
                            "draft", True)  # the draft model runs on torch
        configs[f"draft-model({args.draft_precision}) k={args.draft_k}"] = (
            ModelDrafter(draft, target.vocab_size), args.draft_k)

    rows = []
    for i, p in enumerate(prompts):
        ids = None
        for name, spec in configs.items():
            drafter, k = spec if spec else (None, 1)
            engine = Engine(target, drafter, k=k, tokenizer=tok, eos_ids=eos, chat_template=True)
            ids = ids or engine.encode(p["prompt"])
            res = engine.generate_ids(ids, args.max_new_tokens, target_only=spec is None)
            rows.append({"id": p["id"], "kind": p["kind"], "config": name, "tokens": res.stats.new_tokens,
                         "tok_s": res.stats.tokens_per_s, "decode_tok_s": res.stats.decode_tokens_per_s,
                         "acceptance": res.stats.acceptance_rate, "mean_accepted": res.stats.mean_accepted,
                         "token_ids": res.token_ids})
            print(f"[{i + 1}/{len(prompts)}] {p['id']:<18} {name:<26} {res.stats.summary()}",
                  file=sys.stderr, flush=True)
    report(rows, list(configs))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def report(rows: list[dict], configs: list[str]) -> None:
    base = {r["id"]: r for r in rows if r["config"] == "target-only"}
    by = defaultdict(list)
    for r in rows:
        b = base[r["id"]]
        r["speedup"] = r["tok_s"] / b["tok_s"]
        r["identical"] = r["token_ids"] == b["token_ids"]
        by[(r["kind"], r["config"])].append(r)
    print("| kind | config | tok/s | decode tok/s | speedup (geo-mean) | acceptance | accepted/round | identical |")
    print("|---|---|---|---|---|---|---|---|")
    for kind in sorted({r["kind"] for r in rows}):
        for name in configs:
            rs = by[(kind, name)]
            print(f"| {kind} | {name} | {statistics.mean(r['tok_s'] for r in rs):.1f} | "
                  f"{statistics.mean(r['decode_tok_s'] for r in rs):.1f} | "
                  f"{statistics.geometric_mean(r['speedup'] for r in rs):.2f}x | "
                  f"{statistics.mean(r['acceptance'] for r in rs):.0%} | "
                  f"{statistics.mean(r['mean_accepted'] for r in rs):.2f} | "
                  f"{sum(r['identical'] for r in rs)}/{len(rs)} |")


if __name__ == "__main__":
    sys.exit(main())
