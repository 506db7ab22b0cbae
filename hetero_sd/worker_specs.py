"""Small picklable descriptions of drafters, built where they will run.

A RemoteDrafter hands one of these to its worker process, which builds the
real drafter there (loading the model once); the builder uses the same specs
for drafters that stay in the engine's process.

    NgramSpec(min_ngram=2, max_ngram=4)
    ModelSpec(model="/path/model.gguf", backend="onnxruntime", device="cpu", precision="int4")
    CascadeSpec(inner=NgramSpec(), stage=ModelSpec(...), k=4)   # ngram drafts, the model verifies
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

DEFAULT_KV_BUDGET = 256 * 2**20


@dataclass(frozen=True)
class NgramSpec:
    min_ngram: int = 2
    max_ngram: int = 4

    @property
    def label(self) -> str:
        return "ngram"


@dataclass(frozen=True)
class ModelSpec:
    model: str  # a HF folder or .gguf file (already resolved: workers have no YAML folder)
    backend: str = "torch"
    device: str = "cpu"
    precision: str = "default"
    kv_budget: int = DEFAULT_KV_BUDGET

    @property
    def label(self) -> str:
        return f"{Path(self.model).name}@{self.backend}:{self.device}:{self.precision}"


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


DrafterSpec = Union[NgramSpec, ModelSpec, CascadeSpec]


@dataclass(frozen=True)
class FaultSpec:
    """Test hook: after `after` draft requests answered normally, the worker
    `exit`s (SIGKILL to itself), `hang`s, replies `malformed` bytes, or
    raises an `error` it reports."""

    after: int
    kind: str = "exit"  # exit | hang | malformed | error


@dataclass(frozen=True)
class WorkerOptions:
    target_vocab: int
    mode: str = "sync"  # sync | async (draft ahead between requests; greedy requests only)
    lookahead: int | None = None  # async: tokens to draft beyond a reply; None: k + 1
    threads: int | None = None  # torch / OpenMP threads in the worker; None: the runtime's default
    cpu: int | None = None  # pin the worker to this CPU (Linux)
    env: dict = field(default_factory=dict)  # HETERO_SD_* variables to set in the worker
    fault: FaultSpec | None = None


def hetero_env() -> dict:
    """The HETERO_SD_* environment a worker must see: a forkserver child inherits
    the server's environment, not the engine's current one."""
    return {k: v for k, v in os.environ.items() if k.startswith("HETERO_SD_")}


def has_distributions(spec: DrafterSpec) -> bool:
    """Whether the drafter returns draft distributions under sampling (a
    cascade's and an n-gram's proposals are deterministic: q is one-hot)."""
    return isinstance(spec, ModelSpec)


def load_model(spec: ModelSpec, role: str = "draft model"):
    """A Runner for `spec` (only its backend is imported)."""
    from hetero_sd.backends.base import resolve
    from hetero_sd.backends.registry import BUILTINS, discover, load_builtin
    from hetero_sd.ir.errors import BackendError
    from hetero_sd.ir.model import load_model_ir

    backend = load_builtin(spec.backend) if spec.backend in BUILTINS else discover().get(spec.backend)
    try:
        info, precision = resolve(backend.probe(), spec.backend, spec.device, spec.precision)
    except BackendError as exc:
        raise BackendError(f"{role}: {exc}") from None
    return backend.load(load_model_ir(Path(spec.model)), info.device, precision.name, spec.kv_budget)


def build_local(spec: DrafterSpec, target_vocab: int, load=load_model):
    """The drafter `spec` describes, built in this process."""
    from hetero_sd.drafters import ModelDrafter, NgramDrafter

    if isinstance(spec, NgramSpec):
        return NgramDrafter(spec.min_ngram, spec.max_ngram)
    if isinstance(spec, ModelSpec):
        return ModelDrafter(load(spec), target_vocab, f"draft model {Path(spec.model).name}")
    if isinstance(spec, CascadeSpec):
        from hetero_sd.cascade import CascadeDrafter

        inner = build_local(spec.inner, target_vocab, load)
        return CascadeDrafter(inner, load(spec.stage, "cascade stage"), target_vocab, k=spec.k,
                              desc=spec.stage.label)
    raise TypeError(f"not a drafter spec: {spec!r}")
