"""OpenVINO GenAI as a peer: plain greedy, prompt lookup and a draft model,
each with its CPU defaults and with its exact (lossless) hints.

Fairness (what we measured of GenAI on CPU hosts):
- It reads the same GGUF (same quantized weights). Its draft model must be an
  OpenVINO IR folder, so the GGUF is converted once by GenAI itself
  (enable_save_ov_model) into the hetero-sd cache and reused.
- It gets our token ids as an ov.Tensor (chat template applied once, by our
  tokenizer) and returns ids, so nothing is re-tokenized.
- Its continuous-batching scheduler caches prompt prefixes by default, which
  would let a prompt skip prefill after the warm-up or an earlier prompt:
  every pipeline here is built fresh, prefix caching off, never in chat mode.
- Greedy, no penalties, no stop strings; EOS ignored or obeyed as the bench says
  (ignore_eos; min_new_tokens stays 0, since it masks EOS and changes the argmax).
"""
from __future__ import annotations

import gc
import os
import time
from pathlib import Path

import numpy as np

from hetero_sd.bench.common import Progress, RunResult, Sample, Skip, Workload

EXACT_HINTS = {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0",
               "KV_CACHE_PRECISION": "f32"}
VARIANTS = ("plain", "prompt-lookup", "draft-model")
SIZE_T_MAX = 2 ** 64 - 1  # GenAI's latency config: "don't limit total batch size"


def _import():
    try:
        import openvino as ov
        import openvino_genai as ov_genai
    except ImportError as exc:
        raise Skip(f"openvino-genai is not installed ({exc}); pip install -e '.[peers]'") from None
    return ov, ov_genai


def genai_model(path: Path) -> str:
    """What GenAI can load for `path`: a GGUF file, or a folder holding OpenVINO IR."""
    if path.is_file() and path.suffix == ".gguf":
        return str(path)
    if path.is_dir() and (path / "openvino_model.xml").exists():
        return str(path)
    raise Skip(f"GenAI reads a .gguf file or an OpenVINO IR folder; {path} is neither "
               "(a Hugging Face folder needs `optimum-cli export openvino` first)")


def draft_ir_folder(path: Path, ov_genai) -> str:
    """An OpenVINO IR folder of the draft model (GenAI's draft_model() takes no GGUF), cached."""
    if path.is_dir():
        return genai_model(path)
    genai_model(path)  # a GGUF, or Skip
    from hetero_sd.ir.cache import cache_dir, cached
    from hetero_sd.ir import load_model_ir

    folder = cache_dir("genai-ir", load_model_ir(path).source, genai=ov_genai.__version__)

    def build(xml: Path) -> None:
        link = xml.parent / path.name
        os.symlink(path.resolve(), link)
        # GenAI writes the IR (and its tokenizer IRs) next to the GGUF it reads.
        pipe = ov_genai.LLMPipeline(str(link), "CPU", enable_save_ov_model=True)
        del pipe
        if not xml.exists():
            raise Skip(f"GenAI did not save an OpenVINO IR for {path.name} (enable_save_ov_model)")

    return str(cached(folder, "openvino_model.xml", build).parent)


def _pipeline(ov_genai, model: str, draft: str | None, variant: str, props: dict):
    sched = ov_genai.SchedulerConfig()
    sched.max_num_batched_tokens = SIZE_T_MAX
    sched.enable_prefix_caching = False
    kwargs = dict(scheduler_config=sched, **props)
    if variant == "prompt-lookup":
        kwargs["prompt_lookup"] = True
    elif variant == "draft-model":
        kwargs["draft_model"] = ov_genai.draft_model(draft, "CPU", **props)
    return ov_genai.LLMPipeline(model, "CPU", **kwargs)


def _config(pipe, variant: str, work: Workload, spec: dict):
    cfg = pipe.get_generation_config()
    cfg.do_sample, cfg.num_beams, cfg.num_return_sequences = False, 1, 1
    cfg.repetition_penalty, cfg.presence_penalty, cfg.frequency_penalty = 1.0, 0.0, 0.0
    cfg.min_new_tokens = 0
    cfg.ignore_eos = work.eos_policy == "ignore"
    cfg.stop_token_ids = set(work.stop_ids)
    cfg.stop_strings = set()
    if variant == "prompt-lookup":
        cfg.num_assistant_tokens, cfg.max_ngram_size = spec["ngram_k"], spec["max_ngram"]
    elif variant == "draft-model":
        cfg.num_assistant_tokens = spec["draft_k"]
    return cfg


def _generate(ov, pipe, cfg, ids: list[int], max_new: int):
    arr = np.asarray([ids], dtype=np.int64)  # kept alive across the call (the tensor shares it)
    cfg.max_new_tokens = max_new
    t0 = time.perf_counter()
    res = pipe.generate(ov.Tensor(arr), cfg)
    return res, time.perf_counter() - t0


def _sample(prompt, ids, res, wall: float, work: Workload) -> Sample:
    out, finish = work.strip_eos([int(t) for t in res.tokens[0]])
    ttft = res.perf_metrics.get_ttft().mean / 1e3
    drafted = accepted = None
    ext = getattr(res, "extended_perf_metrics", None)
    if ext is not None:  # draft-model runs report these; prompt lookup does not
        drafted, accepted = int(ext.get_num_draft_tokens()), int(ext.get_num_accepted_tokens())
    return Sample(prompt.id, prompt.kind, len(ids), out, wall, min(ttft, wall), finish, drafted, accepted)


def run_genai(model_path: Path, draft_path: Path, spec: dict, work: Workload,
              progress: Progress) -> tuple[list[RunResult], dict[str, str]]:
    """Six runs: {exact hints, CPU defaults} x {plain, prompt lookup, draft model}."""
    names = [f"genai-{mode} {v}" for mode in ("exact", "default") for v in VARIANTS]
    try:
        ov, ov_genai = _import()
        model = genai_model(model_path)
    except Skip as exc:  # the whole peer: one entry, not six
        progress.log(f"skipped genai: {exc}")
        progress.skip(len(names) * len(work.prompts))
        return [], {"genai (all runs)": str(exc)}
    runs, skipped = [], {}
    for mode, props in (("exact", EXACT_HINTS), ("default", {})):
        for variant in VARIANTS:
            name = f"genai-{mode} {variant}"
            try:
                runs.append(_run_one(ov, ov_genai, name, model, draft_path, variant, props, spec, work, progress))
            except Exception as exc:  # a peer that fails is reported, never fatal
                reason = str(exc) if isinstance(exc, Skip) else f"failed: {type(exc).__name__}: {exc}"
                reason = " ".join(reason.split())  # C++ checks span lines: one line in the report
                if not runs and not skipped and "gguf" in reason.lower():
                    # The first pipeline could not read the target GGUF (GenAI's reader takes only some
                    # quantizations, e.g. not Q4_K_M): every other run would fail alike.
                    progress.log(f"skipped genai: cannot read {model_path.name}: {reason}")
                    progress.skip(len(names) * len(work.prompts))
                    return [], {"genai (all runs)": f"GenAI cannot read {model_path.name}: {reason}"}
                skipped[name] = reason
                progress.log(f"skipped {name}: {skipped[name]}")
                progress.skip(len(work.prompts))
            gc.collect()
    return runs, skipped


def _run_one(ov, ov_genai, name, model, draft_path, variant, props, spec, work, progress) -> RunResult:
    draft = draft_ir_folder(draft_path, ov_genai) if variant == "draft-model" else None
    t0 = time.perf_counter()
    pipe = _pipeline(ov_genai, model, draft, variant, props)
    load_s = time.perf_counter() - t0
    cfg = _config(pipe, variant, work, spec)
    hints = "exact hints " + ", ".join(f"{k}={v}" for k, v in props.items()) if props else "CPU defaults"
    what = {"plain": "plain greedy",
            "prompt-lookup": f"prompt lookup ({spec['ngram_k']} tokens, n-gram {spec['max_ngram']})",
            "draft-model": f"draft model {draft_path.name}, {spec['draft_k']} tokens"}[variant]
    run = RunResult(name, "genai", f"OpenVINO GenAI {ov_genai.__version__} {what}, {hints}, prefix caching off",
                    {"variant": variant, "properties": props, "model": model, "draft": draft,
                     "version": ov_genai.__version__}, own_greedy=name.split()[0] + " plain",
                    lossless_settings=bool(props), load_s=load_s)
    _generate(ov, pipe, cfg, work.warmup_ids, min(8, work.max_new_tokens))  # warm-up, not counted
    for prompt in work.prompts:
        ids = work.ids[prompt.id]
        res, wall = _generate(ov, pipe, cfg, ids, work.max_new_tokens)
        run.samples.append(_sample(prompt, ids, res, wall, work))
        progress.step(f"{name} {prompt.id}")
    progress.log(f"done {name}: {run.label}")
    del pipe
    return run
