"""Drafting during the verify, measured: the share of drafting a verify hides, and the speedup.

    python benchmarks/bench_overlap.py                       # the fake device table (about 1 minute)
    python benchmarks/bench_overlap.py --json overlap.json
    python benchmarks/bench_overlap.py --cpu-pair            # the Qwen pair, draft worker on the other core

The target is a tiny random model on the fake backend's asynchronous device
(hetero_sd/testing/fake_backend.py): every call lasts a declared `--verify-ms`
(flat in the width, as on a GPU) on the device's own thread. The drafter is a
ControlledDrafter (hetero_sd/testing/controlled.py) on this CPU: each draft
token is the target's own greedy token with probability a, and costs a declared
step of 2-10 ms. Three runs each, side by side: target-only, speculation with
draft-then-verify (scheduler.overlap off) and with the next round drafted during
the verify (overlap auto: the fake device is asynchronous and the drafter on
another device). k is the most drafts whose pre-draft (k + 1 tokens) fits in a
verify. Every speculative output is checked equal to target-only's.

hidden: of all drafting seconds (serial drafts and pre-drafts), the share spent
while the device verified. hits: rounds whose drafts a pre-draft gave. The goal
(issue 58) is >= 80% hidden where a round's drafting is shorter than its
verify; the single-branch pre-draft reaches it only where the pre-draft hits
most rounds (a miss drafts serially), and the table says where.
Not a test: speed is measured, never asserted.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path

from hetero_sd.engine import Engine
from hetero_sd.ir import load_model_ir
from hetero_sd.bench.overlap import serial_and_overlapped
from hetero_sd.testing.fake_backend import FakeBackend, FakeCosts, FakeDeviceSpec


def _tiny_models():
    """The tests' tiny model builder (tests/helpers), registered alone as `helpers`: the
    tests folder itself on sys.path would shadow hetero_sd's subpackages with its own."""
    import importlib.util

    if "helpers" not in sys.modules:
        root = Path(__file__).resolve().parents[1] / "tests" / "helpers"
        spec = importlib.util.spec_from_file_location("helpers", root / "__init__.py",
                                                      submodule_search_locations=[str(root)])
        module = importlib.util.module_from_spec(spec)
        sys.modules["helpers"] = module
        spec.loader.exec_module(module)
    from helpers import tiny_models

    return tiny_models


def _target(model_dir: Path, verify_s: float):
    costs = FakeCosts(prefill_per_token_s=0.0, decode_per_token_s=verify_s, verify_base_s=verify_s)
    backend = FakeBackend(devices=[FakeDeviceSpec(device="fake:0", costs=costs, asynchronous=True)],
                          simulate_time=True)
    return backend.load(load_model_ir(model_dir), "fake:0", "fp32", 8 << 20)


def _alone(target, prompt, n):
    return Engine(target, None).generate_ids(prompt, n, target_only=True)


def measure(verify_ms: float, steps_ms: list[float], alphas: list[float], tokens: int) -> list[dict]:
    tiny = _tiny_models()
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny.make_hf_model(Path(tmp) / "tiny", "llama", seed=0)
        target = _target(model, verify_ms / 1e3)
        prompt = tiny.random_prompt(16, seed=3)
        alone = _alone(target, prompt, tokens)
        oracle = alone.token_ids
        rows = []
        for step in steps_ms:
            k = max(1, min(4, int(verify_ms // step) - 1))
            for a in alphas:
                row = {"verify_ms": verify_ms, "step_ms": step, "k": k, "a": a,
                       "target_only_tok_s": alone.stats.tokens_per_s}
                row.update(serial_and_overlapped(target, prompt, oracle, a, step / 1e3, k))
                if not (row["serial_lossless"] and row["overlap_lossless"]):
                    raise SystemExit(f"LOSSLESS VIOLATION: a={a} step={step}")
                row["overlap_over_serial"] = row["overlap_tok_s"] / row["serial_tok_s"]
                row["overlap_over_target"] = row["overlap_tok_s"] / row["target_only_tok_s"]
                rows.append(row)
                print(_line(row), flush=True)
        return rows


PAIR = Path(__file__).resolve().parents[1] / "configs" / "qwen-coder-worker.yaml"
PAIR_PROMPT = "Write a Python function that parses an ISO 8601 date string and returns a datetime."
PAIR_RUNS = (("target-only", {}), ("worker sync, serial", {"drafter.mode": "sync", "scheduler.overlap": "off"}),
             ("worker async (lookahead)", {"drafter.mode": "async", "scheduler.overlap": "off"}),
             ("worker sync, overlap", {"drafter.mode": "sync", "scheduler.overlap": "auto"}))


def measure_pair(tokens: int) -> list[dict]:
    """The Qwen2.5-Coder pair on this CPU (configs/qwen-coder-worker.yaml): the 1.5B target here,
    the 0.5B int4 draft in a worker on the other core, side by side."""
    from hetero_sd.engine import Engine

    rows, base = [], None
    for name, overrides in PAIR_RUNS:
        engine = Engine.from_config(PAIR, target_only=not overrides, **overrides,
                                    **{"generation.max_new_tokens": tokens, "generation.ignore_eos": True})
        try:
            engine.generate(PAIR_PROMPT, target_only=not overrides)  # warm-up (the worker's first draft)
            res = engine.generate(PAIR_PROMPT, target_only=not overrides)
        finally:
            engine.close()
        base = res.token_ids if base is None else base
        if res.token_ids != base:
            raise SystemExit(f"LOSSLESS VIOLATION: {name}")
        st = res.stats
        rows.append({"run": name, "tok_s": st.tokens_per_s, "acceptance": st.acceptance_rate,
                     "hidden": st.hidden_share, "hits": st.predraft_hits / st.rounds if st.rounds else 0.0})
        print(f"{name:26s} {st.tokens_per_s:7.2f} tok/s  x{st.tokens_per_s / rows[0]['tok_s']:.2f}  "
              f"accept {st.acceptance_rate:4.0%}  hidden {st.hidden_share:4.0%}  hits {rows[-1]['hits']:4.0%}",
              flush=True)
    return rows


HEADER = ("verify ms  step ms  k    a  accept  target-only  serial tok/s  overlap tok/s  "
          "overlap/serial  overlap/target  hidden  hits")


def _line(r: dict) -> str:
    return (f"{r['verify_ms']:9.0f}  {r['step_ms']:7.0f}  {r['k']}  {r['a']:.1f}  {r['overlap_acceptance']:6.0%}  "
            f"{r['target_only_tok_s']:11.1f}  {r['serial_tok_s']:12.1f}  {r['overlap_tok_s']:13.1f}  "
            f"{r['overlap_over_serial']:14.2f}  {r['overlap_over_target']:14.2f}  {r['overlap_hidden']:6.0%}  "
            f"{r['overlap_hits']:4.0%}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--verify-ms", type=float, default=20.0)
    ap.add_argument("--steps-ms", default="2,5,10")
    ap.add_argument("--alphas", default="0.5,0.7,0.9")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--cpu-pair", action="store_true",
                    help="instead: the Qwen pair on this CPU, the draft in a worker on the other core")
    args = ap.parse_args(argv)
    if args.cpu_pair:
        print(f"host: {platform.processor() or platform.machine()}, {PAIR.name}, {args.tokens} tokens")
        rows = measure_pair(args.tokens)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
        return
    print(f"host: {platform.processor() or platform.machine()}, fake device (declared latencies)")
    print(HEADER)
    rows = measure(args.verify_ms, [float(s) for s in args.steps_ms.split(",")],
                   [float(a) for a in args.alphas.split(",")], args.tokens)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
