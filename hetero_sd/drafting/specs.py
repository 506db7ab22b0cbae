"""The drafter spec tree: small, frozen, picklable descriptions of drafters.

A config (or the splitter's plan) becomes one of these trees, and
`drafting.build.build_drafter` is the one function that turns a tree into
drafters: in the engine's process, or inside a worker process for the part of
the tree under a WorkerSpec.

    NgramSpec(min_ngram=2, max_ngram=4)                                   prompt lookup
    SuffixSpec(max_depth=24, factor=1.0, min_token_prob=0.1)              suffix decoding
    ModelSpec("/m/draft.gguf", "onnxruntime", "cpu", "int4")              a draft model
    CascadeSpec(inner=NgramSpec(), stage=ModelSpec(...), k=4)             ngram drafts, the model verifies
    WorkerSpec(inner=ModelSpec(...), transport="shm", mode="async")       in its own process

ModelSpec is also what `loading.Loader` loads a runner from (the target too).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator, Union

from hetero_sd.backends.options import DEFAULT as DEFAULT_OPTIONS, BackendOptions
from hetero_sd.cluster.placement import RayPlacement
from hetero_sd.ir.errors import ConfigError

DEFAULT_KV_BUDGET = 256 * 2**20
TRANSPORTS = ("shm", "tcp", "pipe", "inproc", "ray")  # inproc: the worker loop in a thread (tests); ray: an actor
MODES = ("sync", "async")  # async: the worker drafts ahead while the target verifies (greedy)


@dataclass(frozen=True)
class ModelSpec:
    model: str  # a HF folder or .gguf file, resolved (a worker process has no YAML folder)
    backend: str = "torch"
    device: str = "cpu"
    precision: str = "default"
    kv_budget: int = DEFAULT_KV_BUDGET
    role: str = "draft model"  # how errors and progress bars name it ("target", "drafter.stages.0")
    vocab: int | None = None  # a draft's LM head over token ids < vocab only (None: all)
    features: tuple[int, ...] = ()  # decoder layers whose hidden states the runner returns (take_features)
    # a draft whose tokenizer is not the target's: the target model, whose tokenizer its
    # text is translated to and from (drafting/cross_vocab.py); None: they share one
    translate: str | None = None
    # greedy drafts stop below this draft probability; None: where they stop paying
    # (DrafterConfig.min_prob, auto; drafting/model.DraftStop)
    min_prob: float | None = 0.0
    # the switches its backend runs with: kernels, padding, plugins (backends/options.py;
    # a config's `options:` section)
    options: BackendOptions = DEFAULT_OPTIONS

    @property
    def label(self) -> str:
        return f"{Path(self.model).name}@{self.backend}:{self.device}:{self.precision}"


@dataclass(frozen=True)
class NgramSpec:
    min_ngram: int = 2
    max_ngram: int = 4

    @property
    def label(self) -> str:
        return "ngram"


@dataclass(frozen=True)
class SuffixSpec:
    """Suffix decoding (drafting/suffix.py): the longest context suffix of at most
    `max_depth` tokens seen before, in this request or in the last
    `max_cached_requests` outputs, and its most frequent continuation."""

    max_depth: int = 24
    factor: float = 1.0  # drafts <= factor * match length
    min_token_prob: float = 0.1  # stop where the draft's estimated probability falls below
    max_cached_requests: int = 256  # earlier outputs kept (FIFO); 0: this request's context only
    corpus: str | None = None  # a corpus file (drafting/corpus_file.py), pinned in the global tree

    @property
    def label(self) -> str:
        return "suffix"


@dataclass(frozen=True)
class HeadSpec:
    """An EAGLE-3 head (a folder in EAGLE-3's layout) drafting from the target's hidden
    states, in the engine's process, on `backend` (torch on `device`, or onnxruntime on
    the CPU) in `precision`; the target is loaded with `features` (ModelSpec.features) for it."""

    path: str
    target: str  # the target's model: its token embedding is the head's (when the head has none)
    device: str = "cpu"
    features: tuple[int, ...] = ()
    backend: str = "torch"  # torch | onnxruntime (drafting.build.HEAD_PRECISIONS)
    precision: str = "default"

    @property
    def label(self) -> str:
        return f"head({Path(self.path).name})"


@dataclass(frozen=True)
class HybridSpec:
    """Suffix drafts where the context's match is at least `min_match` tokens long,
    the head's (or a draft model's, of any tokenizer) elsewhere (drafting/hybrid.py)."""

    suffix: SuffixSpec
    head: "HeadSpec | ModelSpec"
    min_match: int = 4

    @property
    def parts(self) -> tuple:
        return (self.suffix, self.head)

    @property
    def label(self) -> str:
        return f"hybrid({self.suffix.label}|{self.head.label})"


@dataclass(frozen=True)
class CascadeSpec:
    """`inner` drafts k tokens at a time for the `stage` model to verify; the
    stage's greedy continuation is what the cascade proposes."""

    inner: "DrafterSpec"
    stage: ModelSpec
    k: int = 4

    @property
    def label(self) -> str:
        return f"cascade({self.inner.label}>{self.stage.label})"


@dataclass(frozen=True)
class WorkerSpec:
    """`inner` (and everything inside it) runs in a worker process the engine
    starts and supervises, reached over `transport`."""

    inner: "DrafterSpec"
    transport: str = "shm"
    mode: str = "sync"
    timeout_s: float = 5.0  # a slower reply means a hung worker (it is killed)
    start_timeout_s: float = 300.0  # the same for its start and first draft (model load)
    threads: int | None = None  # the worker's compute threads; None: the runtime's default
    cpus: tuple[int, ...] | None = None  # the worker's CPUs; the engine's process keeps the others
    ray: RayPlacement | None = None  # transport "ray": where the actor goes (hetero_sd/cluster)

    @property
    def label(self) -> str:
        return f"{self.inner.label}@{self.transport}" + ("-async" if self.mode == "async" else "")


DrafterSpec = Union[NgramSpec, SuffixSpec, ModelSpec, HeadSpec, HybridSpec, CascadeSpec, WorkerSpec]


def model_specs(spec: DrafterSpec | None) -> Iterator[ModelSpec]:
    """Every model the tree loads, innermost first."""
    if isinstance(spec, ModelSpec):
        yield spec
    elif isinstance(spec, CascadeSpec):
        yield from model_specs(spec.inner)
        yield spec.stage
    elif isinstance(spec, HybridSpec):
        yield from model_specs(spec.head)
    elif isinstance(spec, WorkerSpec):
        yield from model_specs(spec.inner)


def translated(spec: DrafterSpec | None, target: str, foreign) -> DrafterSpec | None:
    """The tree with every draft model for which `foreign(model)` holds (its tokenizer
    is not the target's) drafting through the target's text. A cascade stage verifies
    its inner drafter's target ids and cannot: that is an error."""
    if isinstance(spec, ModelSpec):
        return replace(spec, translate=target) if foreign(spec) else spec
    if isinstance(spec, CascadeSpec):
        if foreign(spec.stage):
            raise ConfigError(f"{spec.stage.role} {Path(spec.stage.model).name} has another tokenizer than the "
                              "target's: a cascade stage verifies its inner drafter's token ids and must share "
                              "the target's tokenizer (a draft model of another tokenizer drafts as "
                              "drafter.kind: model)")
        return replace(spec, inner=translated(spec.inner, target, foreign))
    if isinstance(spec, WorkerSpec):
        return replace(spec, inner=translated(spec.inner, target, foreign))
    if isinstance(spec, HybridSpec):
        return replace(spec, head=translated(spec.head, target, foreign))
    return spec


def has_distributions(spec: DrafterSpec) -> bool:
    """Whether the drafter returns draft distributions under sampling (a
    cascade's, an n-gram's and a suffix drafter's proposals are deterministic: q is one-hot)."""
    return isinstance(spec, (ModelSpec, HeadSpec, HybridSpec)) or \
        isinstance(spec, WorkerSpec) and has_distributions(spec.inner)
