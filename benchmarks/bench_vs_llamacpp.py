"""Our exact target alone against llama.cpp's C++ `llama-bench`, on the same GGUF
and threads, interleaved round by round (this host drifts 10-50% over minutes,
so only figures measured side by side compare):

    python benchmarks/bench_vs_llamacpp.py --llamacpp-bin ~/.cache/llama.cpp/build/bin \
        [--model default|qwen2.5-coder-1.5b|FILE.gguf] [--target onnxruntime:cpu:gguf ...] \
        [--rounds 3] [--new-tokens 128] [--prefill 512] [--padded] [--native KERNELS ...] [--json FILE]

Per round, in this order: llama-bench decode (-p 0 -n N), each of our targets'
decode, llama-bench prefill (-p P -n 0), each target's prefill, then each
target's verify curve. Ours:
- decode: Engine.generate_ids target-only on the packaged prompts (one per
  round, cycled), new tokens counted, EOS ignored (as llama-bench makes N
  tokens); tok/s = (N - 1) / (total - time to the first token), the whole
  Python path included;
- prefill: one call of P random tokens (logits for the last row), P / seconds;
- verify curve: V(k+1) / V(1) for k = 0..8 at a context of 300 tokens, the
  runner's one-token call (padded or not, as its row check decided) as V(1).
Every target loads with the defaults; `--padded` loads it again with one-token
calls forced padded (backend options pad_single_row: pairs), so the cost of the padding
shows in the same run; each `--native KERNELS` again with options native: KERNELS
(which of our own ops run, backends/native: 0 for onnxruntime's alone, 1 for
all), so the kernels compare side by side. The build of llama.cpp:
docs/benchmarks.md. Not a test: speed is measured, never asserted.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

from hetero_sd.bench.llamacpp_tools import llama_bench, threads  # noqa: E402  (one way to run llama-bench)

CONTEXT = 300  # verify curve: positions before the scored rows
K_MAX = 8


def load_target(model: Path, placement: str, options: dict):
    """The target at `placement` loaded with the backend options' fields `options`."""
    from hetero_sd.backends.options import BackendOptions
    from hetero_sd.engine import Engine
    from hetero_sd.ir import load_model_ir
    from hetero_sd.loading import Loader
    from hetero_sd.drafting.specs import ModelSpec

    backend, device, precision, *graph = placement.split(":")
    chosen = BackendOptions(**options)
    if graph == ["pool"]:  # the graph a host without our SlabAttention runs (attention gathered from the pool)
        chosen = dataclasses.replace(chosen, native=("matmul",))
    runner = Loader()(ModelSpec(str(model), backend, device, precision, 512 << 20, "target", options=chosen))
    ir = load_model_ir(model)
    tok = ir.load_tokenizer()
    # no eos_ids: every run makes exactly the tokens asked for, as llama-bench does
    return Engine(runner, None, tokenizer=tok, chat_template=True), runner


def decode_tok_s(engine, prompt: str, new: int) -> float:
    ids = engine.encode(prompt)
    ids = ids[-max(1, engine.target.max_context - new - 1):]  # (a short-context model keeps the prompt's end)
    req = engine.request(ids, new, stop=[], speculate=False)
    t0 = time.perf_counter()
    req.run()
    result = req.close()
    total = time.perf_counter() - t0
    return (result.stats.new_tokens - 1) / (total - result.stats.prefill_s)


def prefill_tok_s(runner, n: int, seed: int) -> float:
    import numpy as np

    tokens = np.random.default_rng(seed).integers(0, runner.vocab_size, n).tolist()
    seq = runner.allocate(n + 1)
    try:
        t0 = time.perf_counter()
        runner.greedy(seq, tokens, 0, 1)
        return n / (time.perf_counter() - t0)
    finally:
        runner.release(seq)


def verify_curve(runner, seed: int, context: int = CONTEXT, repeats: int = 5) -> list[float]:
    """V(k+1)/V(1), k = 0..K_MAX, medians of `repeats` calls each, after `context` tokens."""
    import numpy as np

    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, runner.vocab_size, context + K_MAX + 1).tolist()
    seq = runner.allocate(context + K_MAX + 2)
    try:
        runner.greedy(seq, tokens[:context], 0, 1)
        times = {}
        for _ in range(repeats):
            for w in range(1, K_MAX + 2):
                runner.truncate(seq, context)
                t0 = time.perf_counter()
                runner.greedy(seq, tokens[context:context + w], context, w)
                times.setdefault(w, []).append(time.perf_counter() - t0)
        one = statistics.median(times[1])
        return [statistics.median(times[w]) / one for w in range(1, K_MAX + 2)]
    finally:
        runner.release(seq)


def run(args) -> dict:
    from hetero_sd.backends import row_check
    from hetero_sd.backends.options import parse_native
    from hetero_sd.bench.prompts import load_prompts
    from hetero_sd.config import resolve_model

    model = resolve_model(args.model, None)
    variants = {"": {}}  # the defaults
    if args.padded:
        variants[" padded"] = {"pad_single_row": "pairs"}
    for kernels in args.native or ():
        variants[f" native={kernels}"] = {"native": parse_native(kernels)}
    targets = {}
    for placement in args.target:
        for suffix, options in variants.items():
            targets[placement + suffix] = load_target(model, placement, options)
    prompts = [p.prompt for p in load_prompts(None)]
    figures = {"llama.cpp": {"decode": [], "prefill": []}}
    for name in targets:
        figures[name] = {"decode": [], "prefill": [], "curve": []}
    for name, (engine, _) in targets.items():  # warm every path once
        decode_tok_s(engine, prompts[0], 8)
    for r in range(args.rounds):
        figures["llama.cpp"]["decode"].append(llama_bench(args.llamacpp_bin, model, 0, args.new_tokens))
        for name, (engine, _) in targets.items():
            figures[name]["decode"].append(decode_tok_s(engine, prompts[r % len(prompts)], args.new_tokens))
        figures["llama.cpp"]["prefill"].append(llama_bench(args.llamacpp_bin, model, args.prefill, 0))
        for name, (_, runner) in targets.items():
            figures[name]["prefill"].append(prefill_tok_s(runner, args.prefill, r))
        for name, (_, runner) in targets.items():
            figures[name]["curve"].append(verify_curve(runner, r, args.context))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{n} {f['decode'][-1]:.1f}" for n, f in figures.items()), file=sys.stderr)
    ref = figures["llama.cpp"]
    rows = {}
    for name, f in figures.items():
        row = {"decode_tok_s": statistics.median(f["decode"]), "prefill_tok_s": statistics.median(f["prefill"]),
               "rounds": {"decode": f["decode"], "prefill": f["prefill"]}}
        if name != "llama.cpp":
            # ratios round by round (side by side), then their median
            row["decode_vs_llamacpp"] = statistics.median(a / b for a, b in zip(f["decode"], ref["decode"]))
            row["prefill_vs_llamacpp"] = statistics.median(a / b for a, b in zip(f["prefill"], ref["prefill"]))
            row["verify_curve"] = [statistics.median(c[k] for c in f["curve"]) for k in range(K_MAX + 1)]
            row["kernel"] = targets[name][1].kernel_choice
        rows[name] = row
    return {"model": str(model), "threads": threads(), "host": row_check.host_signature(), "rounds": args.rounds,
            "new_tokens": args.new_tokens, "prefill": args.prefill, "results": rows}


def render(report: dict) -> str:
    host = report["host"]
    lines = [f"{Path(report['model']).name}, {report['threads']} threads, {report['rounds']} interleaved rounds; "
             f"{host['cpu']} ({' '.join(host['flags'])})",
             f"| run | decode tok/s | vs llama.cpp | prefill {report['prefill']} tok/s | vs llama.cpp | "
             "V(k+1)/V(1), k=0..8 |", "|---|---|---|---|---|---|"]
    for name, r in report["results"].items():
        curve = " ".join(f"{v:.2f}" for v in r.get("verify_curve", []))
        lines.append(f"| {name} | {r['decode_tok_s']:.1f} | {r.get('decode_vs_llamacpp', 1.0):.2f}x | "
                     f"{r['prefill_tok_s']:.1f} | {r.get('prefill_vs_llamacpp', 1.0):.2f}x | {curve} |")
    for name, r in report["results"].items():
        if r.get("kernel"):
            lines.append(f"- {name}: {r['kernel']}")
    return "\n".join(lines)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llamacpp-bin", type=Path, required=True, help="folder with llama-bench (docs/benchmarks.md)")
    p.add_argument("--model", default="default", help="a .gguf, a catalog name, or default (SmolLM2)")
    p.add_argument("--target", action="append", help="backend:device:precision[:pool] (repeatable; "
                   "default onnxruntime:cpu:int4; :pool runs the graph that gathers attention from the pool, "
                   "what a host runs where our SlabAttention cannot)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--context", type=int, default=CONTEXT, help="tokens before the verify curve's rows")
    p.add_argument("--padded", action="store_true", help="each target also with one-token calls forced padded")
    p.add_argument("--native", action="append", metavar="KERNELS",
                   help="each target also with backend options native: KERNELS (repeatable): which of our own ops "
                        "(backends/native) run, e.g. 0 (none: onnxruntime's), matmul (the default), 1 (all)")
    p.add_argument("--json", type=Path, help="write the report here too")
    args = p.parse_args(argv)
    if not args.target:
        args.target = ["onnxruntime:cpu:int4"]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    report = run(args)
    print(render(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
