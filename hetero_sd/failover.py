"""What happens when a device fails mid-generation: wrappers around the Runner
and the Drafter, so the engine's round loop never sees a failure.

A failing drafter costs speed, never output: FailoverDrafter drops it for the
rest of the request (its draft is empty) and asks the Fallback for a
replacement, which starts from the whole committed context. A failing target
is replaced by FailoverRunner with the Fallback's next runner, which replays
every live sequence into its own cache: the tokens at the positions the
failed one held, the first call's as a prefill and the rest as one
verify-shaped call, so a batch-invariant replacement continues
token-identically. With no replacement
left, the call raises GenerationError and the engine attaches the output so
far.

Failover persists, by design: a replacement serves later requests too (a dead
device is not tried again); `Engine.target` / `Engine.drafter` name the live
ones. A drafter dropped without a replacement is tried again at the next
request (a worker drafter restarts its process). Each wrapper keeps the events
it caused until the engine takes them into the request's stats.

Re-planning on acceptance drift (placement: auto) is the Replanner
interface, called by FailoverDrafter.observe after every speculative round.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

from hetero_sd.backends.base import BatchItem, batch_capacity, feature_layers, run_batch
from hetero_sd.drafting.base import Drafter, apply_delta
from hetero_sd.errors import BackendError, ConfigError, GenerationError, KVBudgetError, describe
from hetero_sd.ir.work import DraftRequest, DraftResult


class Fallback(Protocol):
    def next_drafter(self, failed, error: BaseException) -> Drafter | None:
        """A replacement Drafter (already built), or None to go on without drafts."""

    def next_target(self, failed, error: BaseException):
        """A replacement Runner, or None when no other device can take the target."""


class Replanner(Protocol):
    def on_round(self, drafted: int, accepted: int) -> Drafter | None:
        """Fed every speculative round; a new drafter when the plan changed, else None."""


class NoFallback:
    """Explicit placements: drafts stop, the target has no replacement."""

    def next_drafter(self, failed, error):
        return None

    def next_target(self, failed, error):
        return None


class RankedFallback:
    """Replacements in order of preference, built only when needed. Each entry
    is (label, factory); a factory that itself fails is skipped, so a whole
    chain of dead devices ends in target-alone (drafts) or a clear error."""

    def __init__(self, drafters: list[tuple[str, Callable]] = (), targets: list[tuple[str, Callable]] = ()):
        self.drafters, self.targets = list(drafters), list(targets)
        self.log: list[str] = []

    def _next(self, queue):
        while queue:
            label, factory = queue.pop(0)
            try:
                made = factory()
            except Exception as exc:  # the next device may be dead too: keep going
                self.log.append(f"{label} unavailable: {describe(exc)}")
                continue
            self.log.append(f"switched to {label}")
            return made
        return None

    def next_drafter(self, failed, error):
        return self._next(self.drafters)

    def next_target(self, failed, error):
        return self._next(self.targets)


def is_device_failure(exc: BaseException) -> bool:
    """Errors that mean "this device broke", as opposed to bad input or a
    request that cannot fit anywhere, which another device would not fix."""
    return isinstance(exc, Exception) and not isinstance(exc, (ConfigError, GenerationError, KVBudgetError))


def where(runner) -> str:
    at = f"{getattr(runner.device, 'backend', '?')}:{getattr(runner.device, 'device', '?')}"
    node = getattr(runner, "location", None)  # a runner on another machine (cluster.RayRunner)
    return f"{at} on {node}" if node else at


@dataclass
class _Seq:
    inner: int  # the sequence's id in the current runner
    capacity: int
    tokens: list[int] = field(default_factory=list)  # what the cache holds, position by position
    first: int = 0  # tokens of the call that started at position 0 (replayed as a prefill)


class FailoverRunner:
    """A Runner (backends.base.Runner) that outlives its device."""

    def __init__(self, runner, fallback: Fallback):
        self.current, self.fallback = runner, fallback
        self.events: list[str] = []
        self._seqs: dict[int, _Seq] = {}
        self._next_id = 0
        # Hidden states (backends/base.py), passed through when the runner returns
        # them; every replacement must return the same layers (it is loaded from
        # the same spec: _move checks). A failed runner's features not yet taken
        # are carried over; the replay's own are dropped.
        self._layers = feature_layers(runner)
        self._carried: dict[int, object] = {}
        if self._layers:
            self.feature_layers = self._layers
            self.take_features = self._take_features

    device = property(lambda self: self.current.device)
    precision = property(lambda self: self.current.precision)
    vocab_size = property(lambda self: self.current.vocab_size)
    max_context = property(lambda self: self.current.max_context)

    def take_events(self) -> list[str]:
        events, self.events = self.events, []
        return events

    def _guarded(self, call):
        while True:
            try:
                return call()
            except Exception as exc:
                if not is_device_failure(exc):
                    raise
                self._move(exc)

    def allocate(self, capacity: int) -> int:
        inner = self._guarded(lambda: self.current.allocate(capacity))
        self._next_id += 1
        self._seqs[self._next_id] = _Seq(inner, capacity)
        return self._next_id

    def _take_features(self, seq_id: int):
        s = self._seqs.get(seq_id)
        if s is None:
            return None
        carried = self._carried.pop(seq_id, None)
        got = self.current.take_features(s.inner)
        return got if got is not None else carried  # the replacement's are newer

    def _run(self, method: str, seq_id: int, tokens, start: int, num_logits: int):
        s = self._seqs[seq_id]
        self._carried.pop(seq_id, None)
        out = self._guarded(lambda: getattr(self.current, method)(s.inner, tokens, start, num_logits))
        del s.tokens[start:]
        s.tokens.extend(tokens)
        if start == 0:
            s.first = len(tokens)
        return out

    def forward(self, seq_id: int, tokens, start: int, num_logits: int):
        return self._run("forward", seq_id, tokens, start, num_logits)

    @property
    def max_batch(self) -> int:
        return batch_capacity(self.current)

    def forward_batch(self, items: list[BatchItem]) -> list:
        """Several sequences in one target call (backends.base.run_batch); after a
        device failure the batch is re-run on the replacement, ids mapped anew."""
        seqs = [self._seqs[i.seq_id] for i in items]
        for i in items:
            self._carried.pop(i.seq_id, None)
        out = self._guarded(lambda: run_batch(self.current, [
            BatchItem(s.inner, i.tokens, i.start, i.num_logits) for s, i in zip(seqs, items)]))
        for s, i in zip(seqs, items):
            del s.tokens[i.start:]
            s.tokens.extend(i.tokens)
            if i.start == 0:
                s.first = len(i.tokens)
        return out

    def greedy(self, seq_id: int, tokens, start: int, num_logits: int) -> list[int]:
        return self._run("greedy", seq_id, tokens, start, num_logits)

    def copy_prefix(self, src_id: int, dst_id: int, length: int) -> None:
        """The runner's copy_prefix (check `hasattr(runner.current, "copy_prefix")` first);
        dst then replays as a prefill of that prefix after a failover."""
        src, dst = self._seqs[src_id], self._seqs[dst_id]
        self._guarded(lambda: self.current.copy_prefix(src.inner, dst.inner, length))
        dst.tokens[:], dst.first = src.tokens[:length], length

    def tokens(self, seq_id: int) -> list[int]:
        """The tokens whose KV the sequence holds, position by position."""
        return list(self._seqs[seq_id].tokens)

    def truncate(self, seq_id: int, length: int) -> None:
        s = self._seqs[seq_id]
        self._guarded(lambda: self.current.truncate(s.inner, length))
        del s.tokens[length:]

    def length(self, seq_id: int) -> int:
        return len(self._seqs[seq_id].tokens)

    def release(self, seq_id: int) -> None:
        s = self._seqs.pop(seq_id)
        self._carried.pop(seq_id, None)
        try:
            self.current.release(s.inner)
        except Exception as exc:  # the output is complete; a broken pool must not lose it
            self.events.append(f"target {where(self.current)} release failed: {describe(exc)}")

    def usage(self):
        return self.current.usage()

    def _move(self, exc: BaseException) -> None:
        """Replace the failed runner and replay every live sequence into the new one."""
        original = failed = self.current
        self.events.append(f"target {where(failed)} failed: {describe(exc)}")
        while True:
            replacement = self.fallback.next_target(failed, exc)
            if replacement is None:
                raise GenerationError(f"the target on {where(failed)} failed ({describe(exc)}) and no other "
                                      "device can take it") from exc
            if self._layers and feature_layers(replacement) != self._layers:
                self.events.append(f"replacement {where(replacement)} cannot return the hidden states of "
                                   f"layers {list(self._layers)} (it returns {list(feature_layers(replacement))})")
                failed, exc = replacement, BackendError(
                    f"{where(replacement)} cannot return the hidden states of layers {list(self._layers)}")
                continue
            try:
                inner = {seq_id: self._replay(replacement, s) for seq_id, s in self._seqs.items()}
                break
            except Exception as again:
                if not is_device_failure(again):
                    raise
                self.events.append(f"replacement {where(replacement)} failed: {describe(again)}")
                failed, exc = replacement, again
        for seq_id, s in self._seqs.items():
            if self._layers:
                try:
                    kept = original.take_features(s.inner)
                except Exception:  # a dead device's host-side results may be gone too
                    kept = None
                if kept is not None:
                    self._carried[seq_id] = kept
                replacement.take_features(inner[seq_id])  # the replay's: not a call of the caller's
            try:
                original.release(s.inner)
            except Exception:  # a dead device may not even release; its pool goes with it
                pass
        for seq_id, new_id in inner.items():
            self._seqs[seq_id].inner = new_id
        self.current = replacement
        _close(original)
        replayed = sum(len(s.tokens) for s in self._seqs.values())
        self.events.append(f"target moved to {where(replacement)}; {replayed} positions replayed")

    @staticmethod
    def _replay(runner, s: _Seq) -> int:
        new = runner.allocate(s.capacity)
        if s.tokens:
            runner.forward(new, s.tokens[:s.first], 0, 1)
        if len(s.tokens) > s.first:
            runner.forward(new, s.tokens[s.first:], s.first, len(s.tokens) - s.first)
        return new


def _close(runner) -> None:
    """Free what a failed runner still holds elsewhere (a Ray actor still alive after a
    transient error); local runners have no close."""
    try:
        getattr(runner, "close", lambda: None)()
    except Exception:
        pass


class FailoverDrafter(Drafter):
    """A Drafter that never raises: a failing one is dropped or replaced (module docstring)."""

    def __init__(self, drafter: Drafter | None, fallback: Fallback, replanner: Replanner | None = None):
        self.current, self.fallback, self.replanner = drafter, fallback, replanner
        self.live: Drafter | None = None  # drafting for this request; None once dropped
        self.events: list[str] = []
        self.context: list[int] = []  # the committed context, to start a replacement from
        self._fresh = False  # `live` has not been told the context yet
        self._capacity, self._sampler, self._guide = 0, None, None

    @property
    def name(self) -> str:
        return self.current.name if self.current is not None else "none"

    def take_events(self) -> list[str]:
        events, self.events = self.events, []
        return events

    def begin(self, capacity: int, sampler=None, guide=None) -> None:
        self._capacity, self._sampler, self._guide, self.context, self.live = capacity, sampler, guide, [], None
        if self.current is not None:
            self._start(self.current)

    def _begin(self, drafter: Drafter) -> None:
        # Drafters written before guides existed (begin(capacity, sampler)) get
        # none: the engine cuts the drafts the grammar refuses.
        if self._guide is not None and _takes_guide(drafter):
            drafter.begin(self._capacity, self._sampler, self._guide)
        else:
            drafter.begin(self._capacity, self._sampler)

    def _start(self, drafter: Drafter) -> None:
        try:
            self._begin(drafter)
        except Exception as exc:
            self._failed(drafter, exc)
            return
        self.live, self._fresh = drafter, True

    def draft(self, req: DraftRequest) -> DraftResult:
        apply_delta(self.context, req)
        if self.live is None:
            return DraftResult(req.seq_id, [])
        if self._fresh:
            # (features align with the context's end: the replacement gets what this round has)
            req = DraftRequest(req.seq_id, 0, req.k, list(self.context), features=req.features)
        try:
            result = self.live.draft(req)
        except Exception as exc:
            self._failed(self.live, exc)
            return DraftResult(req.seq_id, [])
        self._fresh = False
        return result

    def _failed(self, drafter: Drafter, exc: BaseException) -> None:
        self.live = None
        self.events.append(f"drafter {drafter.name} failed: {describe(exc)}")
        try:
            drafter.reset()
        except Exception:
            pass
        replacement = self.fallback.next_drafter(drafter, exc)
        if replacement is None:
            self.events.append("drafting continues with none")
            return
        self._start(replacement)  # one that fails to start is dropped the same way
        if self.live is replacement:
            self.current = replacement  # persists: later requests draft with it
            self.events.append(f"drafting continues with {replacement.name}")

    def observe(self, drafted: int, accepted: int) -> None:
        """After a speculative round: tell a drafter that learns from outcomes (optional
        Drafter.observe), and let the Replanner swap the drafter."""
        learn = getattr(self.live, "observe", None)
        if learn is not None:
            learn(drafted, accepted)
        if self.replanner is None or self.live is None or not drafted:
            return
        replacement = self.replanner.on_round(drafted, accepted)
        if replacement is None:
            return
        old = self.live
        try:
            self._begin(replacement)
        except Exception as exc:
            self.events.append(f"re-plan to {replacement.name} failed at start: {describe(exc)}")
            return
        try:
            old.reset()
        except Exception as exc:
            self.events.append(f"drafter {old.name} reset failed: {describe(exc)}")
        self.live = self.current = replacement
        self._fresh = True
        self.events.append(f"acceptance drifted: drafter {old.name} -> {replacement.name}")

    @property
    def active(self) -> bool:
        return self.live is not None

    def reset(self) -> None:
        if self.live is not None:
            try:
                self.live.reset()
            except Exception as exc:  # the output is complete; a broken drafter must not lose it
                self.events.append(f"drafter {self.live.name} reset failed: {describe(exc)}")
        self.live = None

    def wait_ready(self) -> None:
        if self.current is not None:
            self.current.wait_ready()

    def close(self) -> None:
        if self.current is not None:
            self.current.close()


def _takes_guide(drafter) -> bool:
    import inspect

    try:
        params = inspect.signature(drafter.begin).parameters.values()
    except (TypeError, ValueError):  # a builtin or C method: assume the current contract
        return True
    return any(p.name == "guide" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params) or \
        sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params) >= 3
