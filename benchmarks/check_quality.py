"""How far each precision's model is from the GGUF's own weights, teacher-forced.

Speculative output equals its own target's, whatever the precision; what the
precision changes is which model that target is. This scores a text with each
precision and compares every position's next-token distribution with the
reference's (default fp32: the file's blocks dequantized, computed in float):
mean and 99th-percentile KL(reference || precision), how often the two pick
the same top token, and the text's mean negative log-likelihood per token.

    python benchmarks/check_quality.py --model qwen2.5-coder-1.5b --precision gguf --precision int4
    python benchmarks/check_quality.py --model default --precision int8 --precision int4 --tokens 1024

The text (default): Python standard-library source (json.decoder, then
textwrap), so no file is downloaded; --text FILE scores your own.
"""
from __future__ import annotations

import argparse
import gc
import inspect
import time
from pathlib import Path

import numpy as np


def _text(path: str | None) -> str:
    if path:
        return Path(path).read_text()
    import json.decoder
    import textwrap

    return inspect.getsource(json.decoder) + "\n" + inspect.getsource(textwrap)


def _log_probs(loader, model: Path, backend: str, precision: str, ids: list[int], chunk: int = 64) -> np.ndarray:
    """[len(ids), vocab] float64 log-probabilities of the next token at every position."""
    from hetero_sd.drafting.specs import ModelSpec

    runner = loader(ModelSpec(str(model), backend, "cpu", precision, 1 << 30, "target", None))
    seq = runner.allocate(len(ids) + 1)
    rows = []
    for start in range(0, len(ids), chunk):
        part = ids[start:start + chunk]
        rows.append(np.asarray(runner.forward(seq, part, start, len(part)), np.float64))
    runner.release(seq)
    del runner
    gc.collect()
    x = np.concatenate(rows)
    x -= x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def main(argv: list[str] | None = None) -> int:
    from hetero_sd.config import resolve_model
    from hetero_sd.loading import Loader

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b", help="a .gguf, a catalog name, or default (SmolLM2)")
    p.add_argument("--backend", default="onnxruntime")
    p.add_argument("--reference", default="fp32", help="the precision compared against (default fp32)")
    p.add_argument("--precision", action="append", help="a precision to score (repeatable; default gguf, int4)")
    p.add_argument("--tokens", type=int, default=512, help="tokens of the text scored")
    p.add_argument("--text", help="a text file to score (default: standard-library source)")
    args = p.parse_args(argv)
    model = resolve_model(args.model, Path("."))
    loader = Loader(progress=True)
    ids = loader.tokenizer(model).encode(_text(args.text))[:args.tokens]
    if len(ids) < 2:
        p.error("the text is shorter than two tokens")
    targets = np.asarray(ids[1:])

    def nll(lp: np.ndarray) -> float:
        return float(-lp[np.arange(len(ids) - 1), targets].mean())

    t0 = time.perf_counter()
    ref = _log_probs(loader, model, args.backend, args.reference, ids)
    print(f"{model.name}, {len(ids)} tokens, {args.backend}; reference {args.reference} "
          f"({time.perf_counter() - t0:.0f} s)")
    print(f"| precision | KL to {args.reference}, mean | KL p99 | top-1 agreement | NLL / token |")
    print("|---|---|---|---|---|")
    print(f"| {args.reference} | - | - | - | {nll(ref):.4f} |")
    for precision in args.precision or ["gguf", "int4"]:
        lp = _log_probs(loader, model, args.backend, precision, ids)
        kl = (np.exp(ref) * (ref - lp)).sum(-1)
        agree = float((lp.argmax(-1) == ref.argmax(-1)).mean())
        print(f"| {precision} | {kl.mean():.4f} | {np.percentile(kl, 99):.4f} | {agree:.3f} | {nll(lp):.4f} |",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
