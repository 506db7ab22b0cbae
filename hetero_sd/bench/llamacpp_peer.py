"""llama.cpp (through llama-cpp-python) as a peer: plain greedy, its prompt-lookup
drafter, and a draft model (a second, smaller GGUF) behind its LlamaDraftModel
interface.

Fairness:
- It reads the same GGUF (same quantized weights) and gets our token ids
  (chat template applied once, by our tokenizer); its own tokenizer is used
  only to check that those ids round-trip through it.
- Greedy is its greedy sampler (temp=0), penalties neutral. Its generate()
  never stops on EOS by itself: the bench's EOS policy is applied here.
- Llama.generate() reuses the KV cache of the longest common prefix with the
  previous call; every prompt here starts from reset() so each pays its
  prefill, as it does in every other run.
- One fresh Llama per configuration, threads = the cores this process may use.
"""
from __future__ import annotations

import gc
import os
import time
from pathlib import Path

import numpy as np

from hetero_sd.bench.common import Progress, RunResult, Sample, Skip, Workload

VARIANTS = ("plain", "prompt-lookup", "draft-model")
N_BATCH = 512
PIP = "pip install llama-cpp-python (see docs/benchmarks.md: build flags on AMX hosts)"


def _import():
    try:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaDraftModel, LlamaPromptLookupDecoding
    except ImportError as exc:
        raise Skip(f"llama-cpp-python is not installed ({exc}); {PIP}") from None
    # GreedyDraftModel is written against this interface without importing it at module
    # level (the import loads the native library): registered here, so isinstance holds.
    LlamaDraftModel.register(GreedyDraftModel)
    return llama_cpp, LlamaPromptLookupDecoding


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def context_size(work: Workload, slack: int) -> int:
    """Room for the longest prompt, every new token and one round of drafts, in 64s. Kept
    tight: with a drafter, llama-cpp-python keeps every position's logits (n_ctx x vocab floats)."""
    longest = max([len(work.warmup_ids), *(len(ids) for ids in work.ids.values())])
    need = longest + work.max_new_tokens + slack + 1
    return -(-need // 64) * 64


class GreedyDraftModel:
    """A llama_cpp LlamaDraftModel: `num_pred_tokens` greedy tokens from a second Llama.

    The draft model's KV cache is kept across calls: each call evaluates only the ids
    after the longest prefix it has already evaluated (the accepted tokens and the
    target's correction), and its last draft token is never evaluated unless a later
    call needs it. `llm` needs what Llama has: n_tokens, input_ids, eval(tokens), n_ctx();
    `logits()` returns the last evaluated position's logits (default: llama.cpp's).
    """

    def __init__(self, llm, num_pred_tokens: int, logits=None):
        self.llm = llm
        self.num_pred_tokens = num_pred_tokens
        self._logits = logits or self._llama_logits
        self._n_vocab = None
        self.evaluated = 0  # draft-model positions evaluated (what caching saves shows here)

    def _llama_logits(self) -> np.ndarray:
        import llama_cpp

        if self._n_vocab is None:
            self._n_vocab = self.llm.n_vocab()
        # Only the last position of the last eval() has logits (logits_all off): index -1.
        ptr = llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self._n_vocab,))

    def reset(self) -> None:
        self.llm.reset()

    def __call__(self, input_ids: np.ndarray, /, **kwargs) -> np.ndarray:
        llm, ids = self.llm, np.asarray(input_ids, dtype=np.intc)
        n = len(ids)
        k = min(self.num_pred_tokens, llm.n_ctx() - n)  # never past the draft's context
        if k <= 0 or n == 0:
            return np.array([], dtype=np.intc)
        cached = np.asarray(llm.input_ids[:llm.n_tokens])
        m = min(len(cached), n)
        differ = np.flatnonzero(cached[:m] != ids[:m])
        keep = int(differ[0]) if len(differ) else m
        keep = min(keep, n - 1)  # the last id is evaluated again if cached: its logits are gone
        llm.n_tokens = keep  # eval() first drops the draft's KV cache from n_tokens on
        llm.eval(ids[keep:].tolist())
        self.evaluated += n - keep
        out = []
        for i in range(k):
            out.append(int(np.argmax(self._logits())))  # first maximum, as llama.cpp's greedy
            if i + 1 < k:
                llm.eval(out[-1:])
                self.evaluated += 1
        return np.array(out, dtype=np.intc)


class _Counting:
    """Wraps a drafter, noting each call's context length and drafts, so acceptance can be
    read off the final output: a round accepted the drafts that equal the tokens there."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def reset(self) -> None:
        self.calls.clear()
        if isinstance(self.inner, GreedyDraftModel):  # (llama.cpp's prompt lookup keeps no state)
            self.inner.reset()

    def __call__(self, input_ids, /, **kwargs):
        drafts = self.inner(input_ids, **kwargs)
        self.calls.append((len(input_ids), [int(t) for t in drafts]))
        return drafts

    def tally(self, full: list[int]) -> tuple[int, int]:
        """(drafted, accepted) over the rounds whose verify the output reached. A round that
        stopped early (the output ended inside it) counts only the drafts it could check."""
        drafted = accepted = 0
        for at, drafts in self.calls:
            window = full[at:at + len(drafts)]
            if not window or not drafts:
                continue
            same = next((i for i, (a, b) in enumerate(zip(drafts, window)) if a != b), len(window))
            drafted += len(drafts) if same < len(window) else len(window)
            accepted += same
        return drafted, accepted


def _generate(llm, counting, ids: list[int], max_new: int, stop_ids: tuple[int, ...]):
    llm.reset()  # no prefix reuse from the previous prompt or run
    if counting is not None:
        counting.reset()  # nor in the draft model: it prefills each prompt too
    out: list[int] = []
    first = None
    t0 = time.perf_counter()
    for tok in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
        if first is None:
            first = time.perf_counter()
        out.append(int(tok))
        if len(out) >= max_new or out[-1] in stop_ids:
            break  # closing the generator: no verify beyond what is needed
    wall = time.perf_counter() - t0
    return out, wall, (first - t0) if first is not None else wall


def _tokenizer_check(llm, work: Workload) -> str:
    """How many prompts' ids llama.cpp's tokenizer gives back from their own text."""
    same = 0
    for ids in work.ids.values():
        try:
            text = llm.detokenize(ids, special=True)
            same += llm.tokenize(text, add_bos=False, special=True) == list(ids)
        except Exception:  # a tokenizer that cannot round-trip counts as not identical
            pass
    return f"{same}/{len(work.ids)} prompts' ids round-trip through llama.cpp's tokenizer"


def _load(llama_cpp, path: Path, n_ctx: int, draft=None):
    # A drafter makes generate() read every position's logits; without logits_all its
    # buffer holds only n_batch rows and a context past n_batch tokens fails.
    return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=N_BATCH, n_threads=cores(),
                           n_threads_batch=cores(), logits_all=draft is not None, draft_model=draft,
                           verbose=False)


def run_llamacpp(model_path: Path, draft_path: Path, spec: dict, work: Workload,
                 progress: Progress) -> tuple[list[RunResult], dict[str, str]]:
    """Three runs: plain greedy, prompt lookup, draft model; each on a fresh Llama."""
    names = [f"llamacpp {v}" for v in VARIANTS]
    try:
        llama_cpp, lookup = _import()
        if not (model_path.is_file() and model_path.suffix == ".gguf"):
            raise Skip(f"llama.cpp reads a .gguf file; {model_path} is not one")
    except Skip as exc:  # the whole peer: one entry, not three
        progress.log(f"skipped llamacpp: {exc}")
        progress.skip(len(names) * len(work.prompts))
        return [], {"llamacpp (all runs)": str(exc)}
    runs, skipped = [], {}
    for variant, name in zip(VARIANTS, names):
        try:
            runs.append(_run_one(llama_cpp, lookup, name, variant, model_path, draft_path, spec, work, progress))
        except Exception as exc:  # a peer that fails is reported, never fatal
            skipped[name] = str(exc) if isinstance(exc, Skip) else f"failed: {type(exc).__name__}: {exc}"
            progress.log(f"skipped {name}: {skipped[name]}")
            progress.skip(len(work.prompts))
        gc.collect()
    return runs, skipped


def _drafter(llama_cpp, lookup, variant: str, draft_path: Path, spec: dict, n_ctx: int):
    """(drafter, what it is)."""
    if variant == "prompt-lookup":
        return (lookup(max_ngram_size=spec["max_ngram"], num_pred_tokens=spec["ngram_k"]),
                f"prompt lookup ({spec['ngram_k']} tokens, n-gram {spec['max_ngram']})")
    if not (draft_path.is_file() and draft_path.suffix == ".gguf"):
        raise Skip(f"llama.cpp's draft model must be a .gguf file; {draft_path} is not one")
    return (GreedyDraftModel(_load(llama_cpp, draft_path, n_ctx), spec["draft_k"]),
            f"draft model {draft_path.name}, {spec['draft_k']} tokens")


def _check(llm, drafter, work: Workload) -> None:
    """Ids llama.cpp would refuse (or a draft of another vocabulary) stop this run, not the bench."""
    top = max(max(ids, default=0) for ids in [work.warmup_ids, *work.ids.values()])
    if top >= llm.n_vocab():
        raise Skip(f"prompt token id {top} is outside {Path(llm.model_path).name}'s {llm.n_vocab()} tokens")
    small = drafter.llm if isinstance(drafter, GreedyDraftModel) else None  # (prompt lookup has no model)
    if small is not None and small.n_vocab() != llm.n_vocab():
        raise Skip(f"the draft has {small.n_vocab()} tokens, the target {llm.n_vocab()}: not one vocabulary")


def _run_one(llama_cpp, lookup, name, variant, model_path, draft_path, spec, work, progress) -> RunResult:
    n_ctx = context_size(work, max(spec["ngram_k"], spec["draft_k"]) + 1)
    drafter, counting, what = None, None, "plain greedy"
    t0 = time.perf_counter()
    if variant != "plain":
        drafter, what = _drafter(llama_cpp, lookup, variant, draft_path, spec, n_ctx)
        counting = _Counting(drafter)
    llm = _load(llama_cpp, model_path, n_ctx, counting)
    load_s = time.perf_counter() - t0
    _check(llm, drafter, work)
    version = getattr(llama_cpp, "__version__", "?")
    run = RunResult(name, "llamacpp", f"llama-cpp-python {version} {what}, greedy, {cores()} threads, "
                    f"n_ctx {n_ctx}, n_batch {N_BATCH}, KV prefix reuse off",
                    {"variant": variant, "version": version, "threads": cores(), "n_ctx": n_ctx,
                     "n_batch": N_BATCH, "draft": str(draft_path) if variant == "draft-model" else None,
                     "tokenizer_check": _tokenizer_check(llm, work)},
                    own_greedy="llamacpp plain", load_s=load_s)
    _generate(llm, counting, work.warmup_ids, min(8, work.max_new_tokens), work.stop_ids)  # warm-up
    for prompt in work.prompts:
        ids = work.ids[prompt.id]
        out, wall, ttft = _generate(llm, counting, ids, work.max_new_tokens, work.stop_ids)
        drafted = accepted = None
        if counting is not None:
            drafted, accepted = counting.tally(list(ids) + out)
        out, finish = work.strip_eos(out)
        run.samples.append(Sample(prompt.id, prompt.kind, len(ids), out, wall, min(ttft, wall), finish,
                                  drafted, accepted))
        progress.step(f"{name} {prompt.id}")
    progress.log(f"done {name}: {run.label}")
    del llm
    return run
