"""The cuda backend on a GPU, with random-weight Llama-3-8B- and 1B-shaped bf16 models:

  lossless    greedy speculative ids (k = 1..8 over 32 prompts: n-gram drafts on prompts that
              repeat themselves, the target drafting for itself on the others, so every
              verify width runs) equal to target-only ids, and 8 sequences decoded
              together equal each alone
  decode      tok/s of our exact step (CUDA graphs) against torch eager (cuBLAS) and torch
              with a CUDA graph (cuBLAS), side by side on the same weights
  verify      V(k+1) / V(1), k = 0..8: the cost of a verify of k drafts over a decode step
  bandwidth   the share of the device's measured copy bandwidth a decode step uses
  memory      what the model, its KV pool and the graphs hold

    python benchmarks/gpu/bench_cuda.py --out DIR            # on a GPU (check.sh runs it)
    TRITON_INTERPRET=1 python benchmarks/gpu/bench_cuda.py --smoke --out DIR   # a CPU dry run

Writes DIR/bench_cuda.json and DIR/bench_cuda.md. Numbers are this run's, on this GPU.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from hetero_sd.backends.base import BatchItem
from hetero_sd.backends.cuda.backend import CudaBackend
from hetero_sd.drafting import ModelDrafter, NgramDrafter
from hetero_sd.engine import Engine
from hetero_sd.ir.config import ModelConfig
from hetero_sd.ir.model import ModelIR
from hetero_sd.ir.weights import WeightSource

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torch_decode import TorchDecode  # noqa: E402

SHAPES = {  # Llama-3.1-8B and Llama-3.2-1B, as their config.json give them
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
               num_kv_heads=8, head_dim=128, tie_word_embeddings=False),
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
               num_kv_heads=8, head_dim=64, tie_word_embeddings=True),
    "smoke": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, tie_word_embeddings=False),
}


class RandomSource(WeightSource):
    """Seeded random weights made on the device, tensor by tensor (no file: an 8B
    checkpoint would take minutes to write); norms are ones."""

    def __init__(self, names: list[str], shapes: dict, device: torch.device):
        self._names, self._shapes, self._device = names, shapes, device
        self._gen = torch.Generator(device=device).manual_seed(0)

    def names(self) -> list[str]:
        return self._names

    def get(self, name: str) -> torch.Tensor:
        shape = self._shapes[name]
        if "norm" in name:
            return torch.ones(shape, device=self._device)
        return torch.randn(shape, generator=self._gen, device=self._device) * 0.02


def random_model(shape: str, device: torch.device) -> ModelIR:
    from hetero_sd.ir.families import decoder

    cfg = ModelConfig(family="llama", rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
                      **SHAPES[shape])
    h, d = cfg.hidden_size, cfg.head_dim
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,),
              "lm_head.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (cfg.num_heads * d, h),
                       p + "self_attn.k_proj.weight": (cfg.num_kv_heads * d, h),
                       p + "self_attn.v_proj.weight": (cfg.num_kv_heads * d, h),
                       p + "self_attn.o_proj.weight": (h, cfg.num_heads * d),
                       p + "mlp.gate_proj.weight": (cfg.intermediate_size, h),
                       p + "mlp.up_proj.weight": (cfg.intermediate_size, h),
                       p + "mlp.down_proj.weight": (h, cfg.intermediate_size)})
    names = decoder.weight_names(cfg)
    return ModelIR(cfg, RandomSource(names, shapes, device), Path(f"random-{shape}"), "hf")


def timed(fn, reps: int, sync) -> float:
    """Median seconds of fn() over reps calls, after a warm-up call (two where reps > 1)."""
    for _ in range(1 if reps == 1 else 2):
        fn()
    times = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def lossless(runner, prompts: list[list[int]], new: int) -> dict:
    """Speculative vs target-only over every prompt (k = 1..8 in turn), and lockstep
    batches of 8 against each sequence alone: divergences counted, never hidden."""
    div = batch_div = drafted = accepted = 0
    alone = []
    for i, prompt in enumerate(prompts):
        k = 1 + i % 8
        drafter = NgramDrafter(1, 3) if i % 2 else ModelDrafter(runner, runner.vocab_size)
        engine = Engine(runner, drafter, k=k)
        base = engine.generate_ids(prompt, new, target_only=True)
        spec = engine.generate_ids(prompt, new)
        div += spec.token_ids != base.token_ids
        drafted, accepted = drafted + spec.stats.drafted, accepted + spec.stats.accepted
        alone.append(base.token_ids)
    for lo in range(0, len(prompts), 8):
        group = prompts[lo:lo + 8]
        seqs = [runner.allocate(len(p) + new) for p in group]
        out = [[int(np.argmax(x[-1]))] for x in runner.forward_batch([BatchItem(s, p, 0, 1) for s, p in zip(seqs, group)])]
        while len(out[0]) < new:
            items = [BatchItem(s, o[-1:], len(p) + len(o) - 1, 1) for s, p, o in zip(seqs, group, out)]
            for o, x in zip(out, runner.forward_batch(items)):
                o.append(int(np.argmax(x[-1])))
        batch_div += sum(o != a for o, a in zip(out, alone[lo:lo + 8]))
        for s in seqs:
            runner.release(s)
    return {"prompts": len(prompts), "new_tokens": new, "speculative_divergences": int(div),
            "batch8_divergences": int(batch_div), "drafted": drafted, "accepted": accepted}


def speed(runner, ir: ModelIR, dev: torch.device, context: int, reps: int) -> dict:
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    seq = runner.allocate(context + 16)
    prompt = list(np.random.default_rng(0).integers(0, ir.config.vocab_size, context))
    runner.forward(seq, prompt, 0, 1)
    verify = {}
    for width in range(1, 10):
        toks = prompt[:width]

        def call(toks=toks, width=width):
            runner.truncate(seq, context)
            runner.greedy(seq, toks, context, width)
        verify[width] = timed(call, reps, sync)
    ours = verify[1]
    peer = TorchDecode(ir.config, runner._forward.w, context + 16, dev, runner.ops.dtype)
    ids = torch.tensor([1], device=dev)
    pos = torch.tensor([context], device=dev)
    eager = timed(lambda: peer.step(ids, pos), reps, sync)
    graph = None
    if dev.type == "cuda":
        peer.capture(ids, pos)
        graph = timed(peer.replay, reps, sync)
    cfg = ir.config
    kv_read = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * (context + 1) * runner.ops.dtype.itemsize
    return {"context": context, "ours_step_s": ours, "torch_eager_step_s": eager, "torch_graph_step_s": graph,
            "ours_tok_s": 1 / ours, "torch_eager_tok_s": 1 / eager, "torch_graph_tok_s": graph and 1 / graph,
            "ours_over_graph": graph and ours / graph,
            "verify_ratio": {f"V({w})/V(1)": verify[w] / verify[1] for w in verify},
            "bytes_per_step": runner.weight_bytes + kv_read}


def copy_bandwidth(dev: torch.device) -> float | None:
    """Bytes a second a device-to-device copy of 2 GiB moves (read + write)."""
    if dev.type != "cuda":
        return None
    a = torch.empty(1 << 31, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    s = timed(lambda: b.copy_(a), 10, torch.cuda.synchronize)
    del a, b
    return 2 * (1 << 31) / s


def bench_shape(shape: str, dev: torch.device, args) -> dict:
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    ir = random_model(shape, dev)
    t = time.perf_counter()
    runner = CudaBackend().load(ir, str(dev), "bf16", args.kv_budget << 20)
    row = {"shape": shape, "load_s": time.perf_counter() - t, "weights_GiB": runner.weight_bytes / 2**30,
           "kernel_choice": runner.kernel_choice}
    rng = np.random.default_rng(1)
    prompts = []
    for i in range(args.prompts):  # every other one repeats its first half: text n-gram drafts can copy
        n = int(rng.integers(args.min_len, args.max_len))
        head = list(map(int, rng.integers(0, ir.config.vocab_size, n // 2 if i % 2 else n)))
        prompts.append(head * 2 if i % 2 else head)
    row["lossless"] = lossless(runner, prompts, args.new)
    row["speed"] = speed(runner, ir, dev, args.context, args.reps)
    if dev.type == "cuda":
        row["peak_memory_GiB"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def markdown(result: dict) -> str:
    lines = [f"GPU: {result['device']} (torch {result['torch']}, Triton {result['triton']})", "",
             "| model | divergences (spec / batch of 8) | ours tok/s | torch eager | torch + graph | "
             "ours / graph step | V(5)/V(1) | HBM share | peak GiB |", "|---|---|---|---|---|---|---|---|---|"]
    for row in result["shapes"]:
        s, ll = row["speed"], row["lossless"]
        bw = result.get("copy_bandwidth_GBs")
        share = f"{s['bytes_per_step'] / s['ours_step_s'] / 1e9 / bw:.0%}" if bw else "-"
        graph = f"{s['torch_graph_tok_s']:.1f}" if s["torch_graph_tok_s"] else "-"
        ratio = f"{s['ours_over_graph']:.2f}x" if s["ours_over_graph"] else "-"
        lines.append(f"| {row['shape']} bf16 | {ll['speculative_divergences']} / {ll['batch8_divergences']} "
                     f"of {ll['prompts']} | {s['ours_tok_s']:.1f} | {s['torch_eager_tok_s']:.1f} | {graph} | "
                     f"{ratio} | {s['verify_ratio']['V(5)/V(1)']:.2f} | {share} | "
                     f"{row.get('peak_memory_GiB', 0):.1f} |")
    lines += ["", "V(k+1)/V(1): " + "; ".join(
        f"{row['shape']}: " + ", ".join(f"{v:.2f}" for v in row["speed"]["verify_ratio"].values())
        for row in result["shapes"])]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shapes", default="8b,1b")
    ap.add_argument("--smoke", action="store_true", help="a tiny shape on the interpreter's cpu device")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--min-len", type=int, default=8, help="prompt length, at least")
    ap.add_argument("--max-len", type=int, default=40, help="prompt length, below")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--kv-budget", type=int, default=4096, help="MiB")
    args = ap.parse_args(argv)
    if args.smoke:
        args.shapes, args.prompts, args.new, args.context, args.reps, args.kv_budget = "smoke", 4, 3, 12, 1, 2
        args.min_len, args.max_len = 4, 9
    dev = torch.device("cuda:0" if torch.cuda.is_available() and not args.smoke else "cpu")
    import triton

    result = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (Triton interpreter)",
              "torch": torch.__version__, "triton": triton.__version__, "shapes": []}
    bw = copy_bandwidth(dev)
    result["copy_bandwidth_GBs"] = bw and bw / 1e9
    for shape in args.shapes.split(","):
        print(f"bench_cuda: {shape} ...", file=sys.stderr, flush=True)
        result["shapes"].append(bench_shape(shape, dev, args))
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    write_result(args.out, "bench_cuda", result, markdown(result))
    return 0


def write_result(out: Path, stem: str, result: dict, md: str) -> None:
    """OUT/stem.json and OUT/stem.md (what check.sh gathers), and the table on stdout."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    (out / f"{stem}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    sys.exit(main())
