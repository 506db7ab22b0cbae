"""Hugging Face transformers generate() as a peer: plain greedy, prompt lookup
(prompt_lookup_num_tokens) and assisted generation (assistant_model), fp32.

Same weights: a Hugging Face folder loads as is; a GGUF is dequantized by
transformers' own GGUF reader (gguf_file=, needs accelerate, ~20 s for
SmolLM2) once, and the result is saved as safetensors under the hetero-sd
cache, so later runs load in about a second. Input is our token ids; the
output ids are counted. Time to first token comes from a streamer (its first
put() after the prompt's).
"""
from __future__ import annotations

import gc
import time
from pathlib import Path

from hetero_sd.bench.common import Progress, RunResult, Sample, Skip, Workload

VARIANTS = ("plain", "prompt-lookup", "assisted")


def _import():
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise Skip(f"transformers is not installed ({exc})") from None
    return torch, transformers


def hf_folder(path: Path, transformers) -> Path:
    """A Hugging Face folder with `path`'s weights: itself, or its GGUF converted once (cached)."""
    if path.is_dir() and (path / "config.json").exists():
        return path
    if not (path.is_file() and path.suffix == ".gguf"):
        raise Skip(f"transformers needs a Hugging Face folder or a .gguf file; {path} is neither")
    from hetero_sd.ir.cache import cache_dir, cached
    from hetero_sd.ir import load_model_ir

    folder = cache_dir("transformers", load_model_ir(path).source, transformers=transformers.__version__)

    def build(config_json: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM
        transformers.utils.logging.disable_progress_bar()
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        except ImportError as exc:  # accelerate or gguf missing
            raise Skip(f"transformers cannot read {path.name}: {exc}") from None
        # The weights are dequantized already; drop the GGUF marker so they save as plain fp32.
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(config_json.parent)

    return cached(folder, "config.json", build).parent


def _load(transformers, torch, folder: Path, dtype, work: Workload):
    transformers.utils.logging.disable_progress_bar()  # our bar is the one on stderr
    transformers.utils.logging.set_verbosity_error()  # its deprecation notes are not bench output
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()
    # A neutral default config: generate() falls back to the model's defaults for unset
    # fields (EOS among them), so the model's own file must not add penalties or stops.
    eos = list(work.stop_ids) or None
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=eos, pad_token_id=(work.eos_ids or (0,))[0], bos_token_id=model.generation_config.bos_token_id)
    return model


class _FirstToken:
    """A generate() streamer that notes when the first new token(s) arrive."""

    def __init__(self):
        self.calls, self.first = 0, None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:  # call 1 carries the prompt
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def _gen_config(transformers, variant: str, work: Workload, spec: dict):
    eos = list(work.stop_ids) or None
    cfg = transformers.GenerationConfig(max_new_tokens=work.max_new_tokens, do_sample=False, num_beams=1,
                                        eos_token_id=eos, pad_token_id=(work.eos_ids or (0,))[0])
    if variant == "prompt-lookup":
        cfg.prompt_lookup_num_tokens, cfg.max_matching_ngram_size = spec["ngram_k"], spec["max_ngram"]
    elif variant == "assisted":
        # A constant draft length, as for every other run (the default heuristic schedule
        # would carry an adapted length from one prompt to the next).
        cfg.num_assistant_tokens, cfg.num_assistant_tokens_schedule = spec["draft_k"], "constant"
    return cfg


def _generate(torch, model, cfg, ids: list[int], max_new: int, assistant=None):
    x = torch.tensor([ids], dtype=torch.long)
    cfg.max_new_tokens = max_new
    streamer = _FirstToken()
    extra = {"assistant_model": assistant} if assistant is not None else {}
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=cfg, streamer=streamer, **extra)
    wall = time.perf_counter() - t0
    ttft = (streamer.first - t0) if streamer.first is not None else wall
    return [int(t) for t in out[0, len(ids):]], wall, ttft


def run_transformers(model_path: Path, draft_path: Path, draft_precision: str, spec: dict, work: Workload,
                     progress: Progress) -> tuple[list[RunResult], dict[str, str]]:
    names = [f"transformers {v}" for v in VARIANTS]
    try:
        torch, transformers = _import()
        t0 = time.perf_counter()
        model = _load(transformers, torch, hf_folder(model_path, transformers), torch.float32, work)
        load_s = time.perf_counter() - t0
    except Exception as exc:  # absent, or cannot read the weights: listed, never fatal
        reason = str(exc) if isinstance(exc, Skip) else f"failed: {type(exc).__name__}: {exc}"
        progress.log(f"skipped transformers: {reason}")
        progress.skip(len(names) * len(work.prompts))
        return [], {"transformers (all runs)": reason}
    runs, skipped = [], {}
    for variant, name in zip(VARIANTS, names):
        try:
            runs.append(_run_one(torch, transformers, model, name, variant, draft_path, draft_precision, spec, work,
                                 load_s, progress))
        except Exception as exc:
            skipped[name] = str(exc) if isinstance(exc, Skip) else f"failed: {type(exc).__name__}: {exc}"
            progress.log(f"skipped {name}: {skipped[name]}")
            progress.skip(len(work.prompts))
        gc.collect()
    return runs, skipped


def _run_one(torch, transformers, model, name, variant, draft_path, draft_precision, spec, work, load_s,
             progress) -> RunResult:
    assistant, what = None, "plain greedy"
    if variant == "prompt-lookup":
        what = f"prompt lookup ({spec['ngram_k']} tokens, n-gram {spec['max_ngram']})"
    elif variant == "assisted":
        # The assistant runs at our draft's precision (bf16 if ours is), so both draft alike.
        dtype = torch.bfloat16 if draft_precision == "bf16" else torch.float32
        t0 = time.perf_counter()
        assistant = _load(transformers, torch, hf_folder(draft_path, transformers), dtype, work)
        load_s += time.perf_counter() - t0
        what = f"assistant_model {draft_path.name} {str(dtype).removeprefix('torch.')}, {spec['draft_k']} tokens"
    attn = getattr(model.config, "_attn_implementation", "?")
    run = RunResult(name, "transformers", f"transformers {transformers.__version__} generate(), {what}, fp32, "
                    f"attention {attn}", {"variant": variant, "version": transformers.__version__,
                                          "torch_threads": torch.get_num_threads()},
                    own_greedy="transformers plain", load_s=load_s)
    cfg = _gen_config(transformers, variant, work, spec)
    _generate(torch, model, cfg, work.warmup_ids, min(8, work.max_new_tokens), assistant)  # warm-up
    for prompt in work.prompts:
        ids = work.ids[prompt.id]
        out, wall, ttft = _generate(torch, model, cfg, ids, work.max_new_tokens, assistant)
        out, finish = work.strip_eos(out)
        run.samples.append(Sample(prompt.id, prompt.kind, len(ids), out, wall, ttft, finish))
        progress.step(f"{name} {prompt.id}")
    progress.log(f"done {name}: {run.label}")
    return run
