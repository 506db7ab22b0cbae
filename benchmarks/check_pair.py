"""Lossless on a real target/draft pair (default: Qwen2.5-Coder 1.5B verified,
0.5B drafting): greedy speculative ids equal target-only ids, for every
target and draft placement given, k = 1..8 spread over the prompts, and seeded
sampling reproduces. Optionally, logits against transformers' own GGUF load.

    python benchmarks/check_pair.py --target onnxruntime:cpu:gguf --target openvino:CPU:gguf \
        --draft onnxruntime:cpu:gguf --draft openvino:CPU:gguf --draft onnxruntime:cpu:int4:32768 \
        --prompts code --prompts default --max-new-tokens 64
    python benchmarks/check_pair.py --logits --target onnxruntime:cpu:gguf --draft onnxruntime:cpu:gguf

A placement is backend:device:precision[:vocab] (vocab: a draft head over the
first N token ids). Exits 1 on any divergence; prints one line per run.
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time

import numpy as np


def _load(path: str, placement: str):
    from hetero_sd.backends.registry import discover
    from hetero_sd.ir import load_model_ir

    backend, device, precision, *vocab = placement.split(":")
    model = load_model_ir(path).with_output_vocab(int(vocab[0]) if vocab else None)
    return discover().get(backend).load(model, device, precision, 256 << 20), (int(vocab[0]) if vocab else None)


def _prompts(sets: list[str], tokenizer) -> list[tuple[str, list[int]]]:
    from hetero_sd.bench.prompts import load_prompts, prompts_path

    out = []
    for name in sets:
        for p in load_prompts(prompts_path(name)):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": p.prompt}], add_generation_prompt=True,
                                                tokenize=True)
            out.append((p.id, list(ids["input_ids"] if hasattr(ids, "keys") else ids)))
    return out


def check_lossless(args, target_path, draft_path, tokenizer) -> int:
    from hetero_sd.drafting import ModelDrafter
    from hetero_sd.engine import Engine
    from hetero_sd.sampling import SamplingParams

    prompts = _prompts(args.prompts, tokenizer)
    failures = runs = 0
    for tplace in args.target:
        target, _ = _load(target_path, tplace)
        bases = {}
        for dplace in args.draft:
            draft, vocab = _load(draft_path, dplace)
            drafter = ModelDrafter(draft, target.vocab_size, head_vocab=vocab)
            ks = itertools.cycle(range(1, 9))
            for pid, ids in prompts:
                for _ in range(2):  # two k per prompt: every k meets several prompts
                    k = next(ks)
                    engine = Engine(target, drafter, k=k)
                    if pid not in bases:
                        bases[pid] = engine.generate_ids(ids, args.max_new_tokens, target_only=True, stop=[])
                    t = time.perf_counter()
                    spec = engine.generate_ids(ids, args.max_new_tokens, stop=[])
                    same = spec.token_ids == bases[pid].token_ids
                    runs, failures = runs + 1, failures + (not same)
                    print(f"{'ok  ' if same else 'DIFF'} target {tplace} draft {dplace} k={k} {pid}: "
                          f"{spec.stats.accepted}/{spec.stats.drafted} accepted, "
                          f"{len(spec.token_ids) / (time.perf_counter() - t):.1f} tok/s", flush=True)
            params = SamplingParams(temperature=0.7, top_p=0.9, seed=5)
            engine = Engine(target, drafter, k=4, sampling=params)
            a, b = (engine.generate_ids(prompts[0][1], 32, stop=[]).token_ids for _ in range(2))
            runs, failures = runs + 1, failures + (a != b)
            print(f"{'ok  ' if a == b else 'DIFF'} sampling seed 5 reproduces: target {tplace} draft {dplace}")
    print(f"{runs - failures}/{runs} runs identical")
    return 1 if failures else 0


def check_logits(args, target_path, draft_path, tokenizer) -> int:
    """Each model's logits on each placement against transformers' GGUF load (fp32)."""
    import torch
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    ids = tokenizer("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")["input_ids"]
    for path, places in ((target_path, args.target), (draft_path, args.draft)):
        p = Path(path)
        t = time.perf_counter()
        hf = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
        with torch.inference_mode():
            ref = hf(torch.tensor([ids])).logits[0].numpy()
        del hf
        print(f"{p.name}: transformers fp32 load + forward {time.perf_counter() - t:.0f} s", flush=True)
        for place in places:
            runner, vocab = _load(path, place)
            got = runner.forward(runner.allocate(len(ids) + 1), ids, 0, len(ids))
            r = ref[:, :got.shape[1]]
            err = np.abs(got - r).max() / r.std()
            agree = (got.argmax(-1) == r.argmax(-1)).mean()
            print(f"  {place}: max |diff| / std = {err:.4f}, argmax agreement {agree:.0%} over {len(ids)} positions")
    return 0


def main(argv=None) -> int:
    from hetero_sd.config import resolve_model
    from hetero_sd.ir import load_model_ir

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft-model", default="qwen2.5-coder-0.5b")
    p.add_argument("--target", action="append", default=[])
    p.add_argument("--draft", action="append", default=[])
    p.add_argument("--prompts", action="append", default=[])
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--logits", action="store_true", help="compare logits with transformers instead")
    args = p.parse_args(argv)
    args.target = args.target or ["onnxruntime:cpu:gguf"]
    args.draft = args.draft or ["onnxruntime:cpu:gguf"]
    args.prompts = args.prompts or ["code"]
    target_path, draft_path = (str(resolve_model(m, None)) for m in (args.model, args.draft_model))
    tokenizer = load_model_ir(target_path).load_tokenizer()
    return (check_logits if args.logits else check_lossless)(args, target_path, draft_path, tokenizer)


if __name__ == "__main__":
    sys.exit(main())
