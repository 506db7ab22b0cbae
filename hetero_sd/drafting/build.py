"""The one function that constructs drafters: `build_drafter(spec, target_vocab, load)`.

The engine's builder calls it for the configured tree, placement: auto for
the plan's choice (and for each failover or re-plan), and a worker process
for the part of the tree it runs. `load` turns a ModelSpec into a Runner
(hetero_sd.loading.Loader); a WorkerSpec's model loads in its worker.
"""
from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Callable

from hetero_sd.drafting import worker
from hetero_sd.drafting.base import Drafter
from hetero_sd.drafting.cascade import CascadeDrafter
from hetero_sd.drafting.model import ModelDrafter
from hetero_sd.drafting.ngram import NgramDrafter
from hetero_sd.drafting.remote import RemoteDrafter
from hetero_sd.drafting.specs import CascadeSpec, DrafterSpec, ModelSpec, NgramSpec, SuffixSpec, WorkerSpec
from hetero_sd.drafting.suffix import SuffixDrafter
from hetero_sd.loading import Loader


def build_drafter(spec: DrafterSpec, target_vocab: int, load: Callable | None = None) -> Drafter:
    """The drafter `spec` describes. A WorkerSpec's worker is started (not
    awaited: call wait_ready() on the result, after loading the target)."""
    load = Loader() if load is None else load
    if isinstance(spec, NgramSpec):
        return NgramDrafter(spec.min_ngram, spec.max_ngram)
    if isinstance(spec, SuffixSpec):
        return SuffixDrafter(spec.max_depth, spec.factor, spec.min_token_prob, spec.max_cached_requests)
    if isinstance(spec, ModelSpec):
        return ModelDrafter(load(spec), target_vocab, f"draft model {Path(spec.model).name}", spec.vocab)
    if isinstance(spec, CascadeSpec):
        inner = build_drafter(spec.inner, target_vocab, load)
        try:
            return CascadeDrafter(inner, load(spec.stage), target_vocab, k=spec.k, desc=spec.stage.label,
                                  head_vocab=spec.stage.vocab)
        except BaseException:
            inner.close()
            raise
    if isinstance(spec, WorkerSpec):
        return RemoteDrafter(spec.inner, target_vocab, entry=worker_entry(), transport=spec.transport,
                             mode=spec.mode, timeout_s=spec.timeout_s, start_timeout_s=spec.start_timeout_s,
                             threads=spec.threads, cpu=spec.cpus)
    raise TypeError(f"not a drafter spec: {spec!r}")


def worker_entry():
    """The worker process's target: the worker loop, building its drafter with this function."""
    return partial(worker.main, build=build_drafter)
