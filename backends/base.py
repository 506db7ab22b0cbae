"""The backend contract: probe, load, run, truncate, release, report.

A backend turns a model IR into a runner on one device. Backends know the IR
and their own runtime, nothing else. Third-party backends implement the same
classes and register under the `hetero_sd.backends` entry-point group.

    Backend  required  name, api_version (== API_VERSION)
                       probe() -> [DeviceInfo]     cheap; [] when the runtime is unusable here
                       load(model, device, precision, kv_budget_bytes, progress=None) -> Runner
             optional  load's `progress(i, total, name)`: call it while streaming weights
                       (tensor i of total), and with total 0 to name a long step (quantizing)
    Runner   required  device, precision, vocab_size, max_context
                       allocate / forward / greedy / truncate / release   (the decode loop)
                       length / usage                                     (reporting)
             optional  max_batch + forward_batch(items): several sequences' rows in one call,
                       each row rounding exactly as in a call of its own (run_batch() loops
                       over forward for a runner without them: max_batch 1)
                       feature_layers + take_features(seq_id): when the model IR names feature
                       layers (ModelIR.with_features; config.feature_layers), every call also
                       computes those decoder layers' outputs (residual stream after layer i,
                       0-based, before the final norm) for every input row; take_features
                       returns them for the sequence's latest forward / greedy / forward_batch
                       call, float32 [T, len(layers) * hidden] (layers concatenated in the
                       given order; T: that call's rows, a BatchItem's own rows), then forgets
                       them (None: no call since). Logits are unchanged by it, bitwise. A model
                       without feature layers costs nothing (feature_layers == ()); a backend
                       that cannot return them leaves take_features out (Loader refuses it;
                       feature_layers(runner) below is what a caller asks)
                       a capability a runner lacks is declared, never faked (a precision
                       whose multi-token calls round differently says batch_invariant=False,
                       and results then say "lossless: up to numerics")
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from hetero_sd.ir.model import ModelIR

API_VERSION = 1  # bumped when Backend/Runner change incompatibly


@dataclass(frozen=True)
class PrecisionInfo:
    name: str  # "fp32" | "bf16" | "fp16" | ...
    batch_invariant: bool  # a k-token verify rounds exactly like k one-token steps
    note: str = ""


@dataclass(frozen=True)
class DeviceInfo:
    backend: str
    device: str  # the backend's own device string, e.g. "cpu", "cuda:0", "npu:0"
    description: str
    precisions: tuple[PrecisionInfo, ...]
    default_precision: str

    def precision(self, name: str) -> PrecisionInfo | None:
        return next((p for p in self.precisions if p.name == name), None)


@dataclass(frozen=True)
class PoolUsage:
    capacity_tokens: int
    used_tokens: int  # reserved by live sequences
    filled_tokens: int  # positions holding valid KV
    bytes_total: int
    sequences: int


@dataclass(frozen=True)
class BatchItem:
    """One sequence's share of a batched forward: as Runner.forward's arguments."""
    seq_id: int
    tokens: Sequence[int]
    start: int
    num_logits: int


class Runner(Protocol):
    """A model loaded on one device, with its own KV pool."""

    device: DeviceInfo
    precision: PrecisionInfo
    vocab_size: int
    max_context: int

    def allocate(self, capacity: int) -> int:
        """Reserve `capacity` positions for a new sequence; return its id."""

    def forward(self, seq_id: int, tokens: Sequence[int], start: int, num_logits: int) -> np.ndarray:
        """Run tokens at positions [start, start+T) (prefill and verify alike);
        return float32 logits [num_logits, vocab] of the last num_logits rows."""

    def greedy(self, seq_id: int, tokens: Sequence[int], start: int, num_logits: int) -> list[int]:
        """As forward, but return the argmax ids (computed on the device)."""

    def truncate(self, seq_id: int, length: int) -> None:
        """Keep the first `length` positions; O(1), no KV data moves."""

    def length(self, seq_id: int) -> int: ...

    def release(self, seq_id: int) -> None: ...

    def usage(self) -> PoolUsage: ...


def batch_capacity(runner) -> int:
    """How many sequences one call of the runner can carry (1: no batched forward)."""
    return getattr(runner, "max_batch", 1) if hasattr(runner, "forward_batch") else 1


def feature_layers(runner) -> tuple[int, ...]:
    """The decoder layers whose hidden states the runner's take_features returns
    (the Runner docstring above); () when it returns none."""
    return tuple(getattr(runner, "feature_layers", ())) if hasattr(runner, "take_features") else ()


def run_batch(runner, items: Sequence[BatchItem]) -> list[np.ndarray]:
    """Logits for every item, in order: the runner's batched forward in calls of
    at most its max_batch sequences, or one forward per sequence."""
    cap = batch_capacity(runner)
    if cap <= 1:
        return [runner.forward(i.seq_id, i.tokens, i.start, i.num_logits) for i in items]
    out: list[np.ndarray] = []
    for lo in range(0, len(items), cap):
        chunk = list(items[lo:lo + cap])
        out += runner.forward_batch(chunk) if len(chunk) > 1 else \
            [runner.forward(chunk[0].seq_id, chunk[0].tokens, chunk[0].start, chunk[0].num_logits)]
    return out


class Backend(Protocol):
    name: str
    api_version: int

    def probe(self) -> list[DeviceInfo]:
        """Cheap: which devices this runtime sees here (empty if unusable)."""

    def load(self, model: ModelIR, device: str, precision: str, kv_budget_bytes: int,
             progress=None) -> Runner: ...


def resolve(devices: list[DeviceInfo], backend: str, device: str, precision: str
            ) -> tuple[DeviceInfo, PrecisionInfo]:
    """Find `device` (case-insensitive; "cuda" means "cuda:0") and `precision`
    ("default" = the device's default) among a backend's probed devices."""
    from hetero_sd.ir.errors import BackendError

    want = device.lower()
    info = next((d for d in devices if d.device.lower() in (want, f"{want}:0")), None)
    if info is None:
        raise BackendError(f"backend {backend!r} has no device {device!r} on this host; "
                           f"available: {', '.join(d.device for d in devices) or 'none'}")
    name = info.default_precision if precision == "default" else precision
    prec = info.precision(name)
    if prec is None:
        raise BackendError(f"{backend}:{info.device} does not support precision {name!r}; "
                           f"supported: {', '.join(p.name for p in info.precisions)}")
    return info, prec
