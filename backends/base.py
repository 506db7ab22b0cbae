"""The backend contract: probe, load, run, truncate, release, report.

A backend turns a model IR into a runner on one device. Backends know the IR
and their own runtime, nothing else. Third-party backends implement the same
classes and register under the `hetero_sd.backends` entry-point group.

    Backend  required  name, api_version (one of API_VERSIONS)
                       probe() -> [DeviceInfo]     cheap; [] when the runtime is unusable here
                       load(model, device, precision, kv_budget_bytes, progress=None) -> Runner
             optional  load's `progress(i, total, name)`: call it while streaming weights
                       (tensor i of total), and with total 0 to name a long step (quantizing)
                       takes_options = True: declares that the class is constructed as
                       Cls(options=BackendOptions) and load takes `options=` (backends/options.py:
                       kernels, padding, plugins; a config's `options:`); undeclared: False,
                       and neither is passed
    Runner   a subclass of Runner below (API version 2). Required: device, precision,
             vocab_size, max_context; allocate / forward / greedy / truncate / release (the
             decode loop); length / usage (reporting). Optional capabilities are declared on
             Runner with their defaults, and callers read the declaration, never probe:
               max_batch + forward_batch(items)    several sequences' rows in one call, each
                                                   row rounding exactly as in a call of its own
                                                   (default: max_batch 1, one forward per item)
               feature_layers + take_features(id)  hidden states of the layers the model IR
                                                   names (ModelIR.with_features) for every
                                                   input row (default: (), none)
               can_copy_prefix + copy_prefix(...)  copy one sequence's leading KV into an empty
                                                   one, bitwise what a prefill would write
                                                   (default: False)
               draft_only()                        said once, before the first sequence, by a drafter:
                                                   its outputs are proposals the target verifies, so
                                                   one row need not round as inside a multi-row call,
                                                   and a runner that pads one-token calls for that
                                                   (pads_single_row) stops; default: nothing
               close()                             free what outlives this process's memory (a
                                                   remote actor); default: nothing to free
               location                            the machine it runs on when not here
               kernel_choice                       what the backend chose for this host and why
                                                   (reports: devices, profile); "" by default
               pads_single_row                     a one-token call runs as two rows (the row
                                                   check, row_check.py), so a call of the token
                                                   and one draft costs the same; False by default
               asynchronous + submit(...) -> Pending  submit returns before the device is done
                                                   and Pending.wait() returns what forward /
                                                   greedy would, so the caller's CPU is free in
                                                   between (a CUDA stream, a fake device with a
                                                   declared latency); the default submit runs
                                                   the call at once (asynchronous False)
             A capability a runner lacks is declared, never faked (a precision whose
             multi-token calls round differently says batch_invariant=False, and results then
             say "lossless: up to numerics").
    API version 1 backends (before the Runner class) still load: their runners are
    wrapped (RequiredOnly) and offer the required methods alone.

take_features, in full: when the model IR names feature layers, every call also
computes those decoder layers' outputs (residual stream after layer i, 0-based,
before the final norm) for every input row; take_features returns them for the
sequence's latest forward / greedy / forward_batch call, float32
[T, len(layers) * hidden] (layers concatenated in the given order; T: that call's
rows, a BatchItem's own rows), then forgets them (None: no call since). Logits
are unchanged by it, bitwise. A model without feature layers costs nothing.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from hetero_sd.ir.model import ModelIR

API_VERSION = 2  # bumped when Backend/Runner change incompatibly (2: runners subclass Runner)
API_VERSIONS = (1, 2)  # what this hetero-sd loads


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
    # precisions this kind of backend has but this device cannot run, with why
    # ("bf16", "needs compute capability 8.0"): named when asked for
    lacks: tuple[tuple[str, str], ...] = ()

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


class Pending:
    """A submitted call (Runner.submit): wait() returns its result, or raises its error.
    done_at: when the device finished (time.perf_counter), where the runner knows it."""

    def __init__(self, wait=None, result=None, error: BaseException | None = None,
                 source: "Pending | None" = None):
        """source: the Pending whose device call this one waits on (done_at reads through)."""
        self._wait, self._result, self._error = wait, result, error
        self._done_at: float | None = None
        self._source = source

    @classmethod
    def run(cls, call) -> "Pending":
        """A call made now (a synchronous runner's submit): its result or error, kept."""
        try:
            done = cls(result=call())
        except Exception as exc:  # (raised at wait, where an asynchronous runner's would be)
            done = cls(error=exc)
        done.finished()
        return done

    def finished(self) -> None:
        """The device is done (a runner calls it where it learns so)."""
        self._done_at = time.perf_counter()

    @property
    def done_at(self) -> float | None:
        return self._source.done_at if self._source is not None else self._done_at

    def then(self, fn) -> "Pending":
        """A Pending of fn(this one's result), done when this one is."""
        return Pending(lambda: fn(self.wait()), source=self)

    def wait(self):
        if self._wait is not None:
            self._result, self._wait = self._wait(), None
        if self._error is not None:
            raise self._error
        return self._result


class DeviceQueue:
    """One thread that runs a runner's submitted calls in order, so submit returns at once:
    an asynchronous device for a runtime whose calls block the caller (the fake backend's
    declared latencies), the way a GPU's stream is one."""

    def __init__(self, name: str):
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(1, name)

    def submit(self, call, *args) -> Pending:
        future = self._pool.submit(call, *args)
        pending = Pending(future.result)
        future.add_done_callback(lambda _: pending.finished())
        return pending


class Runner(ABC):
    """A model loaded on one device, with its own KV pool (module docstring)."""

    device: DeviceInfo
    precision: PrecisionInfo
    vocab_size: int
    max_context: int

    # Optional capabilities, declared (module docstring); subclasses that have one say so.
    max_batch: int = 1
    feature_layers: tuple[int, ...] = ()
    can_copy_prefix: bool = False
    location: str | None = None
    kernel_choice: str = ""
    # A one-token call runs as two rows (the row check found one row rounds apart on this
    # host, row_check.py): a call of the token and one draft costs the same.
    pads_single_row: bool = False
    # submit() returns before the device finishes (module docstring)
    asynchronous: bool = False

    @abstractmethod
    def allocate(self, capacity: int) -> int:
        """Reserve `capacity` positions for a new sequence; return its id."""

    @abstractmethod
    def forward(self, seq_id: int, tokens: Sequence[int], start: int, num_logits: int) -> np.ndarray:
        """Run tokens at positions [start, start+T) (prefill and verify alike);
        return float32 logits [num_logits, vocab] of the last num_logits rows."""

    @abstractmethod
    def greedy(self, seq_id: int, tokens: Sequence[int], start: int, num_logits: int) -> list[int]:
        """As forward, but return the argmax ids (computed on the device)."""

    @abstractmethod
    def truncate(self, seq_id: int, length: int) -> None:
        """Keep the first `length` positions; O(1), no KV data moves."""

    @abstractmethod
    def length(self, seq_id: int) -> int: ...

    @abstractmethod
    def release(self, seq_id: int) -> None: ...

    @abstractmethod
    def usage(self) -> PoolUsage: ...

    def forward_batch(self, items: Sequence[BatchItem]) -> list[np.ndarray]:
        """Optional (max_batch > 1): logits for each item, as forward gives them alone."""
        return [self.forward(i.seq_id, i.tokens, i.start, i.num_logits) for i in items]

    def take_features(self, seq_id: int) -> np.ndarray | None:
        """Optional (feature_layers): the sequence's latest call's hidden states, then forgotten."""
        return None

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Optional (can_copy_prefix): give the empty sequence `dst` the KV of `src`'s
        first `length` positions."""
        from hetero_sd.ir.errors import BackendError

        raise BackendError(f"{self.device.backend}:{self.device.device} cannot copy KV between sequences")

    def submit(self, seq_id: int, tokens: Sequence[int], start: int, num_logits: int,
               greedy: bool = True) -> Pending:
        """Optional (asynchronous): greedy / forward as a call whose result Pending.wait()
        returns. Until then the sequence is the device's: no other call on it."""
        method = self.greedy if greedy else self.forward
        return Pending.run(lambda: method(seq_id, tokens, start, num_logits))

    def draft_only(self) -> None:
        """Optional: this runner drafts (module docstring); before any sequence."""

    def close(self) -> None:
        """Optional: free what this process's exit would not (a remote actor)."""


class Wrapping(Runner):
    """A runner around another (`inner`): the required calls go to it unchanged; a
    subclass changes what it wraps them for."""

    def __init__(self, inner):
        self.inner = inner
        self.device, self.precision = inner.device, inner.precision
        self.vocab_size, self.max_context = inner.vocab_size, inner.max_context

    def allocate(self, capacity):
        return self.inner.allocate(capacity)

    def forward(self, seq_id, tokens, start, num_logits):
        return self.inner.forward(seq_id, tokens, start, num_logits)

    def greedy(self, seq_id, tokens, start, num_logits):
        return self.inner.greedy(seq_id, tokens, start, num_logits)

    def truncate(self, seq_id, length):
        self.inner.truncate(seq_id, length)

    def length(self, seq_id):
        return self.inner.length(seq_id)

    def release(self, seq_id):
        self.inner.release(seq_id)

    def usage(self):
        return self.inner.usage()


class RequiredOnly(Wrapping):
    """An API version 1 backend's runner: the required methods, no optional capability
    (version 1 had no way to declare one)."""


def run_batch(runner: Runner, items: Sequence[BatchItem]) -> list[np.ndarray]:
    """Logits for every item, in order: the runner's batched forward in calls of
    at most its max_batch sequences, or one forward per sequence."""
    cap = runner.max_batch
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
    why = dict(info.lacks).get(name)
    if prec is None and why is not None:
        raise BackendError(f"{backend}:{info.device} ({info.description}) lacks precision {name!r}: {why}; "
                           f"supported: {', '.join(p.name for p in info.precisions)}")
    if prec is None:
        raise BackendError(f"{backend}:{info.device} does not support precision {name!r}; "
                           f"supported: {', '.join(p.name for p in info.precisions)}")
    return info, prec
