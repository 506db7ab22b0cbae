"""Target-only greedy decoding, backend by backend, against OpenVINO GenAI on the same GGUF.

    python benchmarks/bench_backends.py [--prompts ../shared/bench/prompts.jsonl] [--max-new-tokens 64]
                                        [--limit N] [--configs genai-exact,ov-fp32,...] [--json out.json]

Configurations run one after another in one process, each on every prompt:
our backends through the Engine (chat template on, target-only), and
`openvino_genai.LLMPipeline(gguf, "CPU")` with its defaults and with the
exact settings (f32 inference, no dynamic quantisation, f32 KV cache).

How GenAI is fed and kept honest:
- It gets the very token ids the Engine uses (chat template applied by our
  tokenizer) as an `ov.Tensor` input_ids [1, n]; it returns token ids
  (EncodedResults), so no re-tokenizing is needed. Its trailing EOS, which
  GenAI returns and counts, is dropped, as the Engine does.
- On CPU a GGUF path gets GenAI's continuous-batching backend with
  `get_latency_oriented_scheduler_config()`, which turns prefix caching on:
  a prompt sharing a prefix with an earlier one (the chat template's system
  block, a repeated prompt, the warm-up) would skip part of its prefill. Every
  GenAI pipeline here is built with that same scheduler config except
  `enable_prefix_caching=False` (unlimited batched tokens kept), a fresh
  pipeline per configuration, outside chat mode (no start_chat, so no chat
  history is carried either).

Tokens/s counts prefill (wall time of one generate call); decode tok/s
excludes it (ours: (n-1) / (total - prefill); GenAI: 1000 / TPOT from its
perf metrics). "outside" is the share of wall time spent outside the
runtime's own infer calls (ours: InferRequest.wait / InferenceSession.run /
the torch model forward, timed by wrapping them; GenAI: generate duration
minus its inference duration). Token ids are compared with both GenAI runs
and with torch fp32 (the IR's own forward) on each prompt. `--configs` picks
a subset, in run order.
Not a test: speed is measured, never asserted.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from hetero_sd.backends.registry import discover
from hetero_sd.config import default_model_path
from hetero_sd.engine import Engine
from hetero_sd.ir import load_model_ir

DEFAULT_PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "bench" / "prompts.jsonl"
WARMUP_PROMPT = "Name three colours of the rainbow."
KV_BUDGET = 256 << 20
SIZE_T_MAX = 2 ** 64 - 1  # GenAI's latency config: "don't limit total batch size"

GENAI_EXACT = {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0",
               "KV_CACHE_PRECISION": "f32"}
# key -> (label, kind, spec); kind "genai": spec = device properties; "ours": (backend, device, precision)
CONFIGS = {
    "genai-exact": ("GenAI exact (f32, no dyn-quant, f32 KV)", "genai", GENAI_EXACT),
    "genai-default": ("GenAI defaults", "genai", {}),
    "torch-fp32": ("torch fp32", "ours", ("torch", "cpu", "fp32")),
    "ort-fp32": ("onnxruntime fp32", "ours", ("onnxruntime", "cpu", "fp32")),
    "ort-int8": ("onnxruntime int8", "ours", ("onnxruntime", "cpu", "int8")),
    "ort-int4": ("onnxruntime int4", "ours", ("onnxruntime", "cpu", "int4")),
    "ov-fp32": ("openvino fp32", "ours", ("openvino", "CPU", "fp32")),
    "ov-bf16": ("openvino bf16", "ours", ("openvino", "CPU", "bf16")),
    # Opt-in (--configs): NNCF-compressed weights, closer to GenAI's compressed GGUF weights.
    "ov-int8": ("openvino int8", "ours", ("openvino", "CPU", "int8")),
    "ov-int4": ("openvino int4", "ours", ("openvino", "CPU", "int4")),
}
DEFAULT_CONFIGS = ["genai-exact", "genai-default", "torch-fp32", "ort-fp32", "ort-int8", "ort-int4",
                   "ov-fp32", "ov-bf16", "ov-int8", "ov-int4"]
OUR_REFERENCE = "torch-fp32"  # the IR's own forward, tested against transformers


# --------------------------------------------------------------- timing hooks
class InferTimer:
    def __init__(self) -> None:
        self.seconds, self.calls = 0.0, 0

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1
        return timed


class _Proxy:
    """Stands in for a runtime object: one method timed, hot methods bound
    directly (no __getattr__ cost per call), everything else forwarded."""

    def __init__(self, obj, timer: InferTimer, timed: str, direct: tuple[str, ...] = ()):
        self._obj = obj
        setattr(self, timed, timer.wrap(getattr(obj, timed)))
        for name in direct:
            setattr(self, name, getattr(obj, name))

    def __getattr__(self, name):
        return getattr(self._obj, name)


def instrument(runner, timer: InferTimer) -> str:
    """Time the runtime's own call inside a runner; return what is timed ('' if unknown)."""
    if hasattr(runner, "_request") and hasattr(runner._request, "wait"):  # OpenVINORunner
        # The runner starts the request and waits: the wait holds the inference.
        runner._request = _Proxy(runner._request, timer, "wait", ("set_tensor", "get_tensor", "start_async"))
        return "InferRequest.start_async + wait"
    if hasattr(runner, "_session") and hasattr(runner._session, "run"):  # OrtRunner
        runner._session = _Proxy(runner._session, timer, "run")
        return "InferenceSession.run"
    if callable(getattr(runner, "_forward", None)):  # TorchRunner: the model forward is the runtime
        runner._forward = timer.wrap(runner._forward)
        return "torch model forward"
    return ""


# --------------------------------------------------------------- runs
def run_ours(spec, ir, tok, eos, prompts, ids_of, args) -> tuple[list[dict], dict]:
    backend, device, precision = spec
    registry = discover()
    if backend not in registry.backends:
        why = registry.broken.get(backend, "not installed")
        raise _Skip(f"backend {backend!r} unavailable: {why}")
    t0 = time.perf_counter()
    try:
        runner = registry.get(backend).load(ir, device, precision, KV_BUDGET)
    except ImportError as exc:
        raise _Skip(f"{type(exc).__name__}: {exc}") from exc
    except Exception as exc:  # BackendError for an unsupported precision, or a real failure
        raise _Skip(f"load failed: {type(exc).__name__}: {exc}") from exc
    load_s = time.perf_counter() - t0
    timer = InferTimer()
    timed = instrument(runner, timer)
    engine = Engine(runner, None, k=1, tokenizer=tok, eos_ids=eos, chat_template=True)
    for _ in range(args.warmup):
        engine.generate_ids(engine.encode(WARMUP_PROMPT), min(8, args.max_new_tokens), target_only=True)
    rows = []
    for p in prompts:
        ids = ids_of[p["id"]]
        timer.reset()
        res = engine.generate_ids(ids, args.max_new_tokens, target_only=True)
        s = res.stats
        rows.append({"prompt_tokens": len(ids), "tokens": s.new_tokens, "token_ids": list(res.token_ids),
                     "total_s": s.total_s, "prefill_s": s.prefill_s,
                     "tok_s": s.tokens_per_s, "decode_tok_s": s.decode_tokens_per_s,
                     # None when the hook never fired (the runner calls its runtime some other way)
                     "infer_s": timer.seconds if timer.calls else None, "infer_calls": timer.calls or None,
                     "finish": s.finish_reason})
    info = {"load_s": load_s, "timed": timed, "device": runner.device.description,
            "precision_note": runner.precision.note, "batch_invariant": runner.precision.batch_invariant}
    del engine, runner
    gc.collect()
    return rows, info


def run_genai(props, gguf: Path, eos, prompts, ids_of, args, tok) -> tuple[list[dict], dict]:
    try:
        import openvino as ov
        import openvino_genai as ov_genai
    except ImportError as exc:
        raise _Skip(f"openvino-genai unavailable: {exc}") from exc
    sched = ov_genai.SchedulerConfig()
    sched.max_num_batched_tokens = SIZE_T_MAX
    sched.enable_prefix_caching = False
    t0 = time.perf_counter()
    pipe = ov_genai.LLMPipeline(str(gguf), "CPU", scheduler_config=sched, **props)
    load_s = time.perf_counter() - t0

    cfg = pipe.get_generation_config()
    cfg.max_new_tokens = args.max_new_tokens
    cfg.do_sample, cfg.num_beams, cfg.num_return_sequences = False, 1, 1
    cfg.min_new_tokens, cfg.ignore_eos = 0, False
    cfg.stop_token_ids = set(eos)
    cfg.stop_strings = set()
    cfg.repetition_penalty, cfg.presence_penalty, cfg.frequency_penalty = 1.0, 0.0, 0.0

    def generate(ids: list[int], max_new: int):
        arr = np.asarray([ids], dtype=np.int64)  # kept alive across the call
        cfg.max_new_tokens = max_new
        t = time.perf_counter()
        res = pipe.generate(ov.Tensor(arr), cfg)
        return res, time.perf_counter() - t

    warm_ids = Engine(None, tokenizer=tok, chat_template=True).encode(WARMUP_PROMPT)
    for _ in range(args.warmup):
        generate(warm_ids, min(8, args.max_new_tokens))

    # Does GenAI's own template + tokenizer give the ids we feed? (informational)
    template_same = None
    try:
        gtok = pipe.get_tokenizer()
        same = 0
        for p in prompts:
            text = gtok.apply_chat_template([{"role": "user", "content": p["prompt"]}], add_generation_prompt=True)
            got = [int(x) for x in gtok.encode(text, add_special_tokens=False).input_ids.data[0]]
            same += got == ids_of[p["id"]]
        template_same = f"{same}/{len(prompts)}"
    except Exception as exc:  # only a cross-check
        template_same = f"not checked ({type(exc).__name__})"

    rows = []
    for p in prompts:
        ids = ids_of[p["id"]]
        res, wall = generate(ids, args.max_new_tokens)
        out = [int(t) for t in res.tokens[0]]
        if out and out[-1] in eos:  # GenAI returns (and counts) the EOS; the Engine does not
            out = out[:-1]
            finish = "eos"
        else:
            finish = "length"
        m = res.perf_metrics
        ttft_ms, tpot_ms = m.get_ttft().mean, m.get_tpot().mean
        gen_ms, infer_ms = m.get_generate_duration().mean, m.get_inference_duration().mean
        n = len(out)
        rows.append({"prompt_tokens": len(ids), "tokens": n, "token_ids": out,
                     "total_s": wall, "prefill_s": ttft_ms / 1e3,
                     "tok_s": n / wall if wall > 0 else 0.0,
                     "decode_tok_s": 1e3 / tpot_ms if n > 1 and tpot_ms > 0 else 0.0,
                     "decode_tok_s_wall": (n - 1) / (wall - ttft_ms / 1e3) if n > 1 and wall > ttft_ms / 1e3 else 0.0,
                     "genai_generated": m.get_num_generated_tokens(), "genai_generate_s": gen_ms / 1e3,
                     # GenAI reports inference as one sum; outside = generate duration - that
                     "infer_s": infer_ms / 1e3, "outside_base_s": gen_ms / 1e3,
                     "infer_calls": m.get_num_generated_tokens(), "finish": finish})
    info = {"load_s": load_s, "timed": "generate minus inference duration (GenAI perf metrics)",
            "device": f"openvino_genai {ov_genai.__version__}", "props": props,
            "chat_template_ids_match": template_same}
    del pipe
    gc.collect()
    return rows, info


class _Skip(Exception):
    pass


# --------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--limit", type=int, default=None, help="use the first N prompts")
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                    help=f"comma-separated, in run order (default: {','.join(DEFAULT_CONFIGS)}; "
                         f"also available: {','.join(k for k in CONFIGS if k not in DEFAULT_CONFIGS)})")
    ap.add_argument("--warmup", type=int, default=1, help="untimed warm-up generations per configuration")
    ap.add_argument("--json", help="also write per-prompt results here")
    args = ap.parse_args()

    keys = [k.strip() for k in args.configs.split(",") if k.strip()]
    unknown = [k for k in keys if k not in CONFIGS]
    if unknown:
        ap.error(f"unknown config(s) {unknown}; choose from {', '.join(CONFIGS)}")
    prompts = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    if args.limit is not None:
        prompts = prompts[:args.limit]
    if not prompts:
        ap.error("no prompts")

    gguf = default_model_path()
    ir = load_model_ir(gguf)
    tok = ir.load_tokenizer()
    eos = tuple(sorted(set(ir.config.eos_token_ids) | {tok.eos_token_id}))
    # One encoding for everyone: the same ids the Engine builds (chat template on).
    probe = Engine(None, tokenizer=tok, chat_template=True)
    ids_of = {p["id"]: probe.encode(p["prompt"]) for p in prompts}
    print(f"# {gguf.name} | {len(prompts)} prompts | max_new_tokens {args.max_new_tokens} | "
          f"{len(os.sched_getaffinity(0))} CPUs ({platform.processor() or platform.machine()}) | "
          f"{_versions()}", file=sys.stderr, flush=True)

    results: dict[str, list[dict]] = {}
    infos: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    for key in keys:
        label, kind, spec = CONFIGS[key]
        print(f"== {label}", file=sys.stderr, flush=True)
        try:
            if kind == "genai":
                rows, info = run_genai(spec, gguf, eos, prompts, ids_of, args, tok)
            else:
                rows, info = run_ours(spec, ir, tok, eos, prompts, ids_of, args)
        except _Skip as exc:
            skipped[key] = str(exc)
            print(f"   skipped: {exc}", file=sys.stderr, flush=True)
            continue
        except Exception as exc:  # one broken configuration must not lose the others' figures
            skipped[key] = f"failed: {type(exc).__name__}: {exc}"
            print(f"   failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            gc.collect()
            continue
        for p, r in zip(prompts, rows):
            r.update({"id": p["id"], "kind": p["kind"], "config": key})
            print(f"   {p['id']:<18} {r['tokens']:>4} tok  {r['tok_s']:7.1f} tok/s  decode {r['decode_tok_s']:7.1f}"
                  f"  prefill {1e3 * r['prefill_s']:6.0f} ms  [{r['finish']}]", file=sys.stderr, flush=True)
        print(f"   load {info['load_s']:.1f}s; timed: {info['timed'] or 'n/a'}", file=sys.stderr, flush=True)
        results[key], infos[key] = rows, info

    report(results, infos, skipped, prompts, args.max_new_tokens)
    if args.json:
        Path(args.json).write_text(json.dumps({"max_new_tokens": args.max_new_tokens, "versions": _versions(),
                                               "infos": infos, "skipped": skipped,
                                               "rows": [r for rows in results.values() for r in rows]},
                                              indent=1, default=str))
    return 0


def _versions() -> str:
    out = []
    for mod in ("openvino", "openvino_genai", "onnxruntime", "torch"):
        try:
            out.append(f"{mod} {__import__(mod).__version__}")
        except Exception:
            out.append(f"{mod} -")
    return ", ".join(out)


def _geo(values: list[float]) -> float | None:
    values = [v for v in values if v and v > 0 and math.isfinite(v)]
    return statistics.geometric_mean(values) if values else None


def _fmt_ratio(a: float | None, b: float | None) -> str:
    return " / ".join("n/a" if v is None else f"{v:.2f}x" for v in (a, b))


def report(results: dict, infos: dict, skipped: dict, prompts: list[dict], max_new_tokens: int) -> None:
    refs = {ref: {r["id"]: r for r in results.get(ref, [])} for ref in ("genai-exact", "genai-default", OUR_REFERENCE)}
    by = defaultdict(list)
    for key, rows in results.items():
        for r in rows:
            by[(r["kind"], key)].append(r)
    print(f"\nTarget-only greedy, at most {max_new_tokens} new tokens. Ratios: geo-mean over prompts of "
          f"this config's figure / the reference's on the same prompt, as tok/s (incl. prefill) / decode tok/s. "
          f"ids = ref: prompts with token ids equal to the reference's (mean tokens before the first "
          f"difference). outside infer: share of wall time outside the runtime's infer calls, per call.\n")
    print("| kind | config | prompt tok | new tok | tok/s | decode tok/s | prefill ms | vs GenAI exact | "
          "vs GenAI default | outside infer | ids = GenAI exact | ids = GenAI default | "
          f"ids = {CONFIGS[OUR_REFERENCE][0]} |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for kind in sorted({p["kind"] for p in prompts}):
        for key in results:
            rs = by[(kind, key)]
            if not rs:
                continue
            cells = []
            for ref in ("genai-exact", "genai-default"):
                base = refs[ref]
                if not base:
                    cells.append("n/a")
                    continue
                cells.append(_fmt_ratio(_geo([r["tok_s"] / base[r["id"]]["tok_s"] for r in rs
                                              if base[r["id"]]["tok_s"]]),
                                        _geo([r["decode_tok_s"] / base[r["id"]]["decode_tok_s"] for r in rs
                                              if base[r["id"]]["decode_tok_s"]])))
            same = [_same(rs, refs[ref]) for ref in ("genai-exact", "genai-default", OUR_REFERENCE)]
            print(f"| {kind} | {CONFIGS[key][0]} | {statistics.mean(r['prompt_tokens'] for r in rs):.0f} | "
                  f"{statistics.mean(r['tokens'] for r in rs):.0f} | "
                  f"{statistics.mean(r['tok_s'] for r in rs):.1f} | "
                  f"{statistics.mean(r['decode_tok_s'] for r in rs):.1f} | "
                  f"{1e3 * statistics.mean(r['prefill_s'] for r in rs):.0f} | {cells[0]} | {cells[1]} | "
                  f"{_outside(rs)} | {same[0]} | {same[1]} | {same[2]} |")
    print()
    for key, info in infos.items():
        extra = f"; GenAI's own chat template gives our ids on {info['chat_template_ids_match']} prompts" \
            if "chat_template_ids_match" in info else f"; {info.get('precision_note', '')}"
        outside = info["timed"] if key.startswith("genai") else f"wall minus {info['timed'] or 'n/a'}"
        print(f"- {CONFIGS[key][0]}: load {info['load_s']:.1f}s; {info['device']}; outside = {outside}{extra}")
    for key, why in skipped.items():
        print(f"- skipped {CONFIGS[key][0]}: {why}")


def _same(rs: list[dict], base: dict) -> str:
    """Prompts whose ids equal the reference's, and the mean length of the shared prefix."""
    if not base:
        return "n/a"
    equal = sum(r["token_ids"] == base[r["id"]]["token_ids"] for r in rs)
    shared = []
    for r in rs:
        a, b = r["token_ids"], base[r["id"]]["token_ids"]
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        shared.append(n)
    return f"{equal}/{len(rs)}" + ("" if equal == len(rs) else f" ({statistics.mean(shared):.0f} shared)")


def _outside(rs: list[dict]) -> str:
    """Share of time outside the runtime's infer calls, and microseconds of it per call."""
    if any(r.get("infer_s") is None for r in rs):
        return "n/a"
    total = sum(r.get("outside_base_s", r["total_s"]) for r in rs)
    infer = sum(r["infer_s"] for r in rs)
    calls = sum(r["infer_calls"] or 0 for r in rs)
    if total <= 0:
        return "n/a"
    per = f", {1e6 * (total - infer) / calls:.0f} us/step" if calls else ""
    return f"{100 * (total - infer) / total:.1f}%{per}"


if __name__ == "__main__":
    sys.exit(main())
