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
from typing import Callable, ClassVar, Iterator, Union

from hetero_sd.backends.options import DEFAULT as DEFAULT_OPTIONS, BackendOptions
from hetero_sd.cluster.placement import RayPlacement
from hetero_sd.ir.errors import ConfigError

DEFAULT_KV_BUDGET = 256 * 2**20
TRANSPORTS = ("shm", "tcp", "pipe", "inproc", "ray")  # inproc: the worker loop in a thread (tests); ray: an actor
MODES = ("sync", "async")  # async: the worker drafts ahead while the target verifies (greedy)
# where a worker's draft distributions travel (transport/planes.py): auto keeps the host arena (the
# engine verifies on the host); cuda_ipc: CUDA IPC buffers for a drafter on a CUDA device
DATA_PLANES = ("auto", "host", "cuda_ipc")


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

    # The fields that hold specs, in walking order (walk, rebuilt): the tree's shape is declared here only.
    children: ClassVar[tuple[str, ...]] = ()
    # Under sampling it returns draft distributions; an n-gram's, a suffix drafter's and a
    # cascade's proposals are deterministic (q is one-hot).
    has_distributions: ClassVar[bool] = True

    @property
    def label(self) -> str:
        return f"{Path(self.model).name}@{self.backend}:{self.device}:{self.precision}"


@dataclass(frozen=True)
class NgramSpec:
    min_ngram: int = 2
    max_ngram: int = 4

    children: ClassVar[tuple[str, ...]] = ()
    has_distributions: ClassVar[bool] = False

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

    children: ClassVar[tuple[str, ...]] = ()
    has_distributions: ClassVar[bool] = False

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

    children: ClassVar[tuple[str, ...]] = ()
    has_distributions: ClassVar[bool] = True

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

    children: ClassVar[tuple[str, ...]] = ("suffix", "head")
    has_distributions: ClassVar[bool] = True

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

    children: ClassVar[tuple[str, ...]] = ("inner", "stage")
    has_distributions: ClassVar[bool] = False

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
    data_plane: str = "auto"  # DATA_PLANES

    children: ClassVar[tuple[str, ...]] = ("inner",)

    @property
    def has_distributions(self) -> bool:
        return self.inner.has_distributions

    @property
    def label(self) -> str:
        return f"{self.inner.label}@{self.transport}" + ("-async" if self.mode == "async" else "")


DrafterSpec = Union[NgramSpec, SuffixSpec, ModelSpec, HeadSpec, HybridSpec, CascadeSpec, WorkerSpec]


def walk(spec: DrafterSpec | None) -> Iterator[DrafterSpec]:
    """Every node of the tree, each after its children (in their declared order):
    the innermost first."""
    if spec is None:
        return
    for name in spec.children:
        yield from walk(getattr(spec, name))
    yield spec


def rebuilt(spec: DrafterSpec | None, change: Callable[[DrafterSpec], DrafterSpec]) -> DrafterSpec | None:
    """The tree with `change` applied to every node, each before its children (an outer
    node's check runs first), and each node's children rebuilt from what `change` returned."""
    if spec is None:
        return None
    node = change(spec)
    if not node.children:  # a leaf: nothing to rebuild (it stays the object it was)
        return node
    return replace(node, **{name: rebuilt(getattr(node, name), change) for name in node.children})


def model_specs(spec: DrafterSpec | None) -> Iterator[ModelSpec]:
    """Every model the tree loads, innermost first."""
    return (node for node in walk(spec) if isinstance(node, ModelSpec))


def translated(spec: DrafterSpec | None, target: str, foreign) -> DrafterSpec | None:
    """The tree with every draft model for which `foreign(model)` holds (its tokenizer
    is not the target's) drafting through the target's text. A cascade stage verifies
    its inner drafter's target ids and cannot: that is an error."""
    def change(node: DrafterSpec) -> DrafterSpec:
        if isinstance(node, CascadeSpec) and foreign(node.stage):
            raise ConfigError(f"{node.stage.role} {Path(node.stage.model).name} has another tokenizer than the "
                              "target's: a cascade stage verifies its inner drafter's token ids and must share "
                              "the target's tokenizer (a draft model of another tokenizer drafts as "
                              "drafter.kind: model)")
        return replace(node, translate=target) if isinstance(node, ModelSpec) and foreign(node) else node

    return rebuilt(spec, change)


def has_distributions(spec: DrafterSpec) -> bool:
    """Whether the drafter returns draft distributions under sampling (each node declares it)."""
    return spec.has_distributions


def device_list(spec: DrafterSpec | None) -> tuple[str, ...]:
    """The devices the tree's models and heads run on, innermost first."""
    return tuple(node.device for node in walk(spec) if isinstance(node, (ModelSpec, HeadSpec)))
