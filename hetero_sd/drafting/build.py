"""The one function that constructs drafters: `build_drafter(spec, target_vocab, load)`.

The engine's builder and placement: auto (for each failover or re-plan) reach it
through `build_for_target`, which first makes every draft model of another tokenizer
than the target's draft through the text; a worker process calls it for the part
of the tree it runs (already translated). `load` turns a ModelSpec into a Runner
(hetero_sd.loading.Loader); a WorkerSpec's model loads in its worker.
"""
from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Callable

from hetero_sd.drafting import worker
from hetero_sd.drafting.base import Drafter
from hetero_sd.drafting.cascade import CascadeDrafter
from hetero_sd.drafting.corpus_file import load_corpus
from hetero_sd.drafting.cross_vocab import CrossVocabDrafter, TokenizerCodec, VocabBridge
from hetero_sd.drafting.head import HeadDrafter
from hetero_sd.drafting.hybrid import HEAD_MIN_RATE, HybridDrafter
from hetero_sd.drafting.model import ModelDrafter
from hetero_sd.drafting.ngram import NgramDrafter
from hetero_sd.drafting.remote import RemoteDrafter
from hetero_sd.drafting.specs import (CascadeSpec, DrafterSpec, HeadSpec, HybridSpec, ModelSpec, NgramSpec,
                                      SuffixSpec, WorkerSpec, translated)
from hetero_sd.drafting.suffix import SuffixDrafter
from hetero_sd.ir.errors import ConfigError
from hetero_sd.loading import Loader


def _suffix_args(spec: SuffixSpec, target_vocab: int) -> dict:
    corpus = load_corpus(spec.corpus, target_vocab) if spec.corpus is not None else ()
    return dict(max_depth=spec.max_depth, factor=spec.factor, min_token_prob=spec.min_token_prob,
                max_cached_requests=spec.max_cached_requests, corpus=corpus)


def build_for_target(spec: DrafterSpec, target_model: str, load: Loader) -> Drafter:
    """The drafter `spec` describes, drafting for the target `target_model`: a draft
    model whose tokenizer is not the target's drafts through the target's text (the
    rule lives here only, for the builder and for auto's failover and re-plans)."""
    target_ir = load.ir(target_model)
    target = str(target_ir.source)
    spec = translated(spec, target, lambda model: not load.shares_tokenizer(model.model, target))
    return build_drafter(spec, target_ir.config.vocab_size, load)


def build_drafter(spec: DrafterSpec, target_vocab: int, load: Callable | None = None) -> Drafter:
    """The drafter `spec` describes. A WorkerSpec's worker is started (not
    awaited: call wait_ready() on the result, after loading the target)."""
    load = Loader() if load is None else load
    if isinstance(spec, NgramSpec):
        return NgramDrafter(spec.min_ngram, spec.max_ngram)
    if isinstance(spec, SuffixSpec):
        return SuffixDrafter(**_suffix_args(spec, target_vocab))
    if isinstance(spec, ModelSpec):
        if spec.translate is not None:
            return cross_vocab_drafter(spec, target_vocab, load)
        return ModelDrafter(drafting_runner(spec, load), target_vocab, f"draft model {Path(spec.model).name}", spec.vocab,
                            spec.min_prob)
    if isinstance(spec, HeadSpec):
        return HeadDrafter(load_head(spec, load), target_vocab)
    if isinstance(spec, HybridSpec):
        # a draft model's min_prob bounds its drafts; a head's weak rounds are gated by its rate
        gate = None if isinstance(spec.head, ModelSpec) else HEAD_MIN_RATE
        suffix = SuffixDrafter(**_suffix_args(spec.suffix, target_vocab))
        return HybridDrafter(suffix, build_drafter(spec.head, target_vocab, load), spec.min_match, gate)
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
                             threads=spec.threads, cpu=spec.cpus, ray=spec.ray, data_plane=spec.data_plane)
    raise TypeError(f"not a drafter spec: {spec!r}")


def drafting_runner(spec: ModelSpec, load):
    """A draft model's runner, told it drafts (Runner.draft_only): its one-token calls need
    not round as inside a verify, so a runner that pads them for the target's sake stops."""
    runner = load(spec)
    runner.draft_only()
    return runner


def cross_vocab_drafter(spec: ModelSpec, target_vocab: int, load) -> CrossVocabDrafter:
    """A draft model of another tokenizer than the target's (spec.translate names the target).
    vocab: N restricts its head to its own first N ids (the bridge maps those alone)."""
    draft_tok, target_tok = load.tokenizer(spec.model), load.tokenizer(spec.translate)
    runner = drafting_runner(spec, load)
    try:
        bridge = VocabBridge(TokenizerCodec(target_tok), TokenizerCodec(draft_tok), target_vocab, runner.vocab_size)
        return CrossVocabDrafter(runner, bridge, spec.min_prob)
    except BaseException:
        runner.close()
        raise


# A head's backends and their precisions (the first is what "default" means there).
HEAD_PRECISIONS = {"torch": ("fp32",), "onnxruntime": ("int8", "fp32", "int4")}


def load_head(spec: HeadSpec, load):
    """The head's runner on its backend (the target's token embedding when it has none of its own)."""
    from hetero_sd.ir.eagle import EagleHead

    allowed = HEAD_PRECISIONS.get(spec.backend)
    if allowed is None:
        raise ConfigError(f"drafter.backend: {spec.backend!r} cannot run a draft head "
                          f"(one of: {', '.join(HEAD_PRECISIONS)})")
    precision = allowed[0] if spec.precision == "default" else spec.precision
    if precision not in allowed:
        raise ConfigError(f"drafter.precision: {spec.precision!r} is not a {spec.backend} head precision "
                          f"(one of: default, {', '.join(allowed)})")
    if spec.backend == "onnxruntime" and spec.device != "cpu":
        raise ConfigError(f"drafter.device: {spec.device!r}: an onnxruntime head runs on cpu only")
    head = EagleHead.load(spec.path, load.ir(spec.target).weights.get("model.embed_tokens.weight"))
    if spec.backend == "onnxruntime":
        from hetero_sd.backends.onnx_head import OrtHeadRunner

        return OrtHeadRunner(head, precision)
    from hetero_sd.backends.torch_head import TorchHeadRunner

    return TorchHeadRunner(head, spec.device)


def worker_entry():
    """The worker process's target: the worker loop, building its drafter with this function."""
    return partial(worker.main, build=build_drafter)
