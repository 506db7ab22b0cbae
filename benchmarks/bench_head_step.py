"""What one EAGLE-3 head call costs on each head runner: a one-row draft step
(hidden=, the call a draft repeats k - 1 times) and a 4-row features call
(features=, once a round), for a head shaped for the target (random weights:
the cost does not depend on them), after `--context` cached rows.

    python benchmarks/bench_head_step.py [--model default] [--draft-vocab 4096] [--context 256]
                                         [--repeats 300] [--block 1] [--runners torch,ort-fp32,ort-int8,ort-int4]
    (a runner name may end in @N: onnxruntime with N threads)

Medians of --repeats calls, the runners interleaved call by call (and their
order rotated) so host drift hits every column alike; ratios against the first
runner. Wall time and this process's CPU time (all its threads): on a loaded
host a call longer than a scheduler slice is often preempted, so the wall
medians of longer calls inflate; the CPU medians do not. With --block 1 every
call follows another runner's (its weights cold in the caches); --block 7 is
a k = 8 draft's steps, back to back. Not a test: speed is measured, never asserted.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch

RUNNERS = ("torch", "ort-fp32", "ort-int8", "ort-int4")


def make_head(target_cfg, draft_vocab: int, embed: torch.Tensor | None = None, seed: int = 0):
    from hetero_sd.ir.eagle import EagleHead, HeadConfig

    torch.manual_seed(seed)
    cfg = HeadConfig.for_target(target_cfg, draft_vocab)
    m = cfg.model
    if embed is None:
        embed = torch.randn(m.vocab_size, m.hidden_size) * 0.05
    head = EagleHead(cfg, embed).eval()
    head.set_vocab(torch.arange(cfg.draft_vocab))
    return head


def make_runner(name: str, head):
    from hetero_sd.backends.torch_head import TorchHeadRunner
    from hetero_sd.backends.onnx_head import OrtHeadRunner

    kind, _, threads = name.partition("@")  # ort-int8@1: one onnxruntime thread
    if kind == "torch":
        return TorchHeadRunner(head)
    return OrtHeadRunner(head, kind.split("-", 1)[1], int(threads) if threads else None)


def measure(head, names: list[str], context: int, repeats: int, rows: int = 4, block: int = 1) -> dict:
    """name -> {"load_s", "step_ms", "features_ms", ...} (medians), runners interleaved; each
    runner makes `block` calls in a row per turn (a draft's steps run back to back), each timed."""
    cfg = head.cfg
    feats = np.random.default_rng(0).standard_normal((context, len(cfg.aux_layers) * cfg.target_hidden),
                                                     dtype=np.float32)
    tokens = list(np.random.default_rng(1).integers(0, cfg.model.vocab_size, context + rows))
    tokens = [int(t) for t in tokens]
    runners, load, hidden = {}, {}, {}
    for name in names:
        t0 = time.perf_counter()
        runners[name] = make_runner(name, head)
        load[name] = time.perf_counter() - t0
        r = runners[name]
        r.begin(context + rows + 8)
        hidden[name], _ = r.run(tokens[:context], 0, 0, features=feats)  # the cached rows

    def step(name):
        runners[name].run([tokens[context]], context, 0, hidden=hidden[name])

    def features(name):
        runners[name].run(tokens[context - rows:context], context - rows, 0, features=feats[-rows:])

    times = {(name, kind): [] for name in names for kind in ("step", "features")}
    cpu = {key: [] for key in times}
    for kind, call in (("step", step), ("features", features)):
        for name in names:
            call(name)  # warm
        for i in range(repeats):
            for j in range(len(names)):
                name = names[(i + j) % len(names)]
                for _ in range(block):
                    t0, c0 = time.perf_counter(), time.process_time()
                    call(name)
                    times[name, kind].append(time.perf_counter() - t0)
                    cpu[name, kind].append(time.process_time() - c0)
    ms = lambda v: statistics.median(v) * 1e3  # noqa: E731
    return {name: {"load_s": load[name], "step_ms": ms(times[name, "step"]), "features_ms": ms(times[name, "features"]),
                   "step_cpu_ms": ms(cpu[name, "step"]), "features_cpu_ms": ms(cpu[name, "features"])}
            for name in names}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="the target (its shapes; a name, folder or .gguf)")
    p.add_argument("--draft-vocab", type=int, default=4096)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--repeats", type=int, default=300)
    p.add_argument("--runners", default=",".join(RUNNERS))
    p.add_argument("--block", type=int, default=1, help="calls in a row per runner's turn (a draft: k - 1)")
    p.add_argument("--threads", type=int, default=0, help="torch's threads (0: its default)")
    args = p.parse_args(argv)
    from hetero_sd.config import resolve_model
    from hetero_sd.ir import load_model_ir

    if args.threads:
        torch.set_num_threads(args.threads)
    names = args.runners.split(",")
    bad = sorted({n for n in names if n.partition("@")[0] not in RUNNERS})
    if bad:
        p.error(f"unknown runner(s) {bad}: choose from {', '.join(RUNNERS)}")
    ir = load_model_ir(resolve_model(args.model, None))
    head = make_head(ir.config, args.draft_vocab)
    m = head.cfg.model
    print(f"head for {ir.config.family} hidden {m.hidden_size}, heads {m.num_heads}/{m.num_kv_heads}, "
          f"intermediate {m.intermediate_size}, draft vocab {head.cfg.draft_vocab}; context {args.context}, "
          f"{args.repeats} interleaved repeats of {args.block} call(s) in a row")
    res = measure(head, names, args.context, args.repeats, block=args.block)
    base = res[names[0]]
    cols = [("step_ms", "1-row wall ms"), ("step_cpu_ms", "1-row cpu ms"), ("features_ms", "4-row wall ms"),
            ("features_cpu_ms", "4-row cpu ms")]
    print(f"{'runner':12} {'load s':>6}" + "".join(f" {title:>14} {'x ' + names[0]:>12}" for _, title in cols))
    for name in names:
        r = res[name]
        print(f"{name:12} {r['load_s']:6.2f}" + "".join(f" {r[key]:14.3f} {r[key] / base[key]:12.3f}"
                                                    for key, _ in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
