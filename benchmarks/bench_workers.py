"""Draft model in-process vs in its own process over shared memory, sync vs async.

    python benchmarks/bench_workers.py [--max-new-tokens 64] [--prompts 4]
        [--target torch:cpu:fp32] [--draft onnxruntime:cpu:int4] [--k 4]
        [--transports shm,tcp] [--worker-threads N] [--json out.json]

One target is loaded once; every configuration decodes the same prompts (from
hetero_sd/bench/prompts.jsonl, chat template applied, EOS ignored so lengths
are equal) after a warm-up, and its tokens are checked against target-only.
Reported per configuration: tokens/s and its ratio to target-only and to the
in-process drafter, and where the time goes:
  engine  prefill, draft (waiting for drafts), verify, other; CPU seconds
  worker  drafting on request, transport (wait minus worker drafting),
          drafting ahead (async: overlapped with verification), idle, CPU seconds
Not a test: speed is measured here, never asserted. On a shared 2-core host
run it when the machine is otherwise idle.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace

from hetero_sd.bench.prompts import load_prompts
from hetero_sd.config import default_model_path
from hetero_sd.drafting.build import build_drafter
from hetero_sd.drafting.remote import RemoteDrafter, WorkerStats
from hetero_sd.drafting.specs import ModelSpec, WorkerSpec
from hetero_sd.engine import Engine
from hetero_sd.ir.model import load_model_ir
from hetero_sd.loading import Loader


def _cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of a process (Linux /proc), this one when pid is None."""
    if pid is None:
        return time.process_time()
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def _spec(text: str, model: str) -> ModelSpec:
    backend, device, precision = text.split(":")
    return ModelSpec(model, backend, device, precision)


def _run_config(name, engine, prompts, new, baseline):
    drafter = engine.drafter
    remote = drafter if isinstance(drafter, RemoteDrafter) else None
    engine.generate_ids(prompts[0], min(8, new))  # warm-up (first-call costs, worker caches)
    before = replace(remote.stats) if remote else WorkerStats()
    pid = remote.pid if remote else None
    cpu0, wcpu0 = _cpu_s(None), _cpu_s(pid)
    totals = {k: 0.0 for k in ("total_s", "prefill_s", "draft_s", "verify_s", "other_s")}
    tokens = drafted = accepted = rounds = 0
    outputs = []
    for ids in prompts:
        res = engine.generate_ids(ids, new, target_only=drafter is None)
        st = res.stats
        for k in totals:
            totals[k] += getattr(st, k)
        tokens, drafted, accepted, rounds = (tokens + st.new_tokens, drafted + st.drafted,
                                             accepted + st.accepted, rounds + st.rounds)
        outputs.append(res.token_ids)
    row = {"config": name, "tokens": tokens, "tok_s": tokens / totals["total_s"], **totals,
           "engine_cpu_s": _cpu_s(None) - cpu0, "acceptance": accepted / drafted if drafted else 0.0,
           "accepted_per_round": accepted / rounds if rounds else 0.0,
           "identical": baseline is None or outputs == baseline}
    if remote is not None:
        after = remote.stats
        diff = {k: getattr(after, k) - getattr(before, k) for k in
                ("rounds", "fresh", "partial", "ahead", "wait_s", "compute_s", "ahead_s", "failures")}
        busy = diff["compute_s"] + diff["ahead_s"]
        row.update(worker=diff, worker_transport_s=max(0.0, diff["wait_s"] - diff["compute_s"]),
                   worker_idle_s=max(0.0, totals["total_s"] - busy),
                   worker_cpu_s=_cpu_s(remote.pid) - wcpu0 if remote.pid == pid else float("nan"))
    return row, outputs


def _print(rows):
    base = rows[0]["tok_s"]
    inproc = next((r["tok_s"] for r in rows if r["config"] == "in-process"), None)
    print(f"{'config':<22}{'tok/s':>8}{'x base':>8}{'x inproc':>9}{'accept':>8}{'same':>6}"
          f"{'prefill':>9}{'draft':>8}{'verify':>8}{'other':>8}{'cpu':>7}")
    for r in rows:
        print(f"{r['config']:<22}{r['tok_s']:>8.1f}{r['tok_s'] / base:>8.2f}"
              f"{(r['tok_s'] / inproc) if inproc else float('nan'):>9.2f}{r['acceptance']:>8.0%}"
              f"{'yes' if r['identical'] else 'NO':>6}{r['prefill_s']:>9.2f}{r['draft_s']:>8.2f}"
              f"{r['verify_s']:>8.2f}{r['other_s']:>8.2f}{r['engine_cpu_s']:>7.2f}")
    workers = [r for r in rows if "worker" in r]
    if workers:
        print(f"\n{'worker of':<22}{'drafting':>9}{'transport':>10}{'ahead':>8}{'idle':>8}{'cpu':>7}"
              f"{'rounds':>8}{'fresh':>7}{'partial':>8}{'served ahead':>13}")
        for r in workers:
            w = r["worker"]
            print(f"{r['config']:<22}{w['compute_s']:>9.2f}{r['worker_transport_s']:>10.3f}{w['ahead_s']:>8.2f}"
                  f"{r['worker_idle_s']:>8.2f}{r['worker_cpu_s']:>7.2f}{w['rounds']:>8}{w['fresh']:>7}"
                  f"{w['partial']:>8}{w['ahead']:>13}")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=4, help="how many prompts (alternating grounded / open)")
    ap.add_argument("--model", default=None, help="model file or folder (default: the embedded SmolLM2)")
    ap.add_argument("--target", default="torch:cpu:fp32", help="backend:device:precision")
    ap.add_argument("--draft", default="onnxruntime:cpu:int4", help="backend:device:precision of the draft")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--transports", default="shm", help="worker transports to compare (shm, tcp, pipe)")
    ap.add_argument("--worker-threads", type=int, default=None)
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)

    model = args.model or str(default_model_path())
    target_spec, draft_spec = _spec(args.target, model), _spec(args.draft, model)
    target_ir = load_model_ir(target_spec.model)
    load = Loader()
    target = load(replace(target_spec, role="target"))
    tokenizer = target_ir.load_tokenizer()
    grounded, open_ = load_prompts(kinds=["grounded"]), load_prompts(kinds=["open"])
    picked = [p for pair in zip(grounded, open_) for p in pair][:args.prompts]
    encoder = Engine(target, None, tokenizer=tokenizer, chat_template=True)
    prompts = [encoder.encode(p.prompt) for p in picked]
    print(f"target {args.target}, draft {args.draft}, k={args.k}, {len(prompts)} prompts "
          f"({', '.join(p.id for p in picked)}), {args.max_new_tokens} new tokens each", file=sys.stderr)

    configs = [("target-only", None),
               ("in-process", build_drafter(draft_spec, target.vocab_size, load))]
    for transport in [t.strip() for t in args.transports.split(",") if t.strip()]:
        for mode in ("sync", "async"):
            configs.append((f"worker {transport} {mode}",
                            build_drafter(WorkerSpec(draft_spec, transport, mode, threads=args.worker_threads),
                                          target.vocab_size)))
    rows, baseline = [], None
    try:
        for name, drafter in configs:
            if isinstance(drafter, RemoteDrafter):
                drafter.wait_ready()
            engine = Engine(target, drafter, k=args.k, tokenizer=tokenizer, eos_ids=())
            row, outputs = _run_config(name, engine, prompts, args.max_new_tokens, baseline)
            rows.append(row)
            baseline = outputs if baseline is None else baseline
            print(f"  done: {name}", file=sys.stderr)
    finally:
        for _, drafter in configs:
            if isinstance(drafter, RemoteDrafter):
                drafter.close()
    _print(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2, default=str)
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
