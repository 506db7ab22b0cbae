"""FailoverRunner: a target Runner that outlives its device (the package docstring).

It records, per sequence, what the cache holds as a prefix of the request's
token history plus the rows written beyond it (drafts not yet committed), so
a replacement replays exactly that: the first call's tokens as a prefill and
the rest as one verify-shaped call, so a batch-invariant replacement
continues token-identically.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hetero_sd.backends.base import BatchItem, Pending, Runner, run_batch
from hetero_sd.errors import BackendError, GenerationError, describe
from hetero_sd.failover.fallback import Fallback, _close, is_device_failure, where
from hetero_sd.ir.work import TokenHistory


@dataclass
class _Seq:
    """What one sequence's cache holds: history.ids[:known] followed by `tail`
    (rows a call wrote beyond the history: drafts not yet committed, or all of
    them for a sequence allocated without a history). The history is the
    request's own, read, never copied."""
    inner: int  # the sequence's id in the current runner
    capacity: int
    history: TokenHistory
    known: int = 0
    tail: list[int] = field(default_factory=list)
    first: int = 0  # tokens of the call that started at position 0 (replayed as a prefill)

    def tokens(self) -> list[int]:
        return self.history.ids[:self.known] + self.tail

    def wrote(self, start: int, tokens) -> None:
        """The cache now holds its first `start` positions, then `tokens`."""
        if start <= self.known:
            self.known, self.tail = start, list(tokens)
        else:
            self.tail = self.tail[:start - self.known] + list(tokens)
        if start == 0:
            self.first = len(self.tail)
        self._settle()

    def cut(self, length: int) -> None:
        if length <= self.known:
            self.known, self.tail = length, []
        else:
            del self.tail[length - self.known:]
        self._settle()

    def _settle(self) -> None:
        """Rows the history has since committed leave the tail."""
        ids, n = self.history.ids, 0
        while n < len(self.tail) and self.known + n < len(ids) and ids[self.known + n] == self.tail[n]:
            n += 1
        if n:
            self.known += n
            del self.tail[:n]


class FailoverRunner(Runner):
    """A Runner (backends.base.Runner) that outlives its device. Its optional
    capabilities are the live runner's (a replacement must return the same
    feature layers: _move checks)."""

    def __init__(self, runner: Runner, fallback: Fallback):
        self.current, self.fallback = runner, fallback
        self.events: list[str] = []
        self._seqs: dict[int, _Seq] = {}
        self._next_id = 0
        # A failed runner's features not yet taken are carried over; the replay's own are dropped.
        self._layers = tuple(runner.feature_layers)
        self._carried: dict[int, object] = {}

    device = property(lambda self: self.current.device)
    precision = property(lambda self: self.current.precision)
    vocab_size = property(lambda self: self.current.vocab_size)
    max_context = property(lambda self: self.current.max_context)
    max_batch = property(lambda self: self.current.max_batch)
    can_copy_prefix = property(lambda self: self.current.can_copy_prefix)
    location = property(lambda self: self.current.location)
    pads_single_row = property(lambda self: self.current.pads_single_row)
    asynchronous = property(lambda self: self.current.asynchronous)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self._layers

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

    def allocate(self, capacity: int, history: TokenHistory | None = None) -> int:
        """`history`: the request's tokens, which the cache holds a prefix of between
        its steps (a failover replays it); without one the runner records what it is given."""
        inner = self._guarded(lambda: self.current.allocate(capacity))
        self._next_id += 1
        self._seqs[self._next_id] = _Seq(inner, capacity, history if history is not None else TokenHistory([]))
        return self._next_id

    def take_features(self, seq_id: int):
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
        s.wrote(start, tokens)
        return out

    def forward(self, seq_id: int, tokens, start: int, num_logits: int):
        return self._run("forward", seq_id, tokens, start, num_logits)

    def submit(self, seq_id: int, tokens, start: int, num_logits: int, greedy: bool = True) -> Pending:
        """The live runner's submit; a device failure, at submit or at wait, moves every
        sequence to the replacement, which runs the call again (synchronously)."""
        s, method = self._seqs[seq_id], "greedy" if greedy else "forward"
        self._carried.pop(seq_id, None)
        try:
            inner = self.current.submit(s.inner, tokens, start, num_logits, greedy)
        except Exception as exc:
            inner = Pending(error=exc)

        def wait():
            try:
                out = inner.wait()
            except Exception as exc:
                if not is_device_failure(exc):
                    raise
                self._move(exc)
                out = self._guarded(lambda: getattr(self.current, method)(s.inner, tokens, start, num_logits))
            s.wrote(start, tokens)
            return out
        return Pending(wait, source=inner)

    def greedy(self, seq_id: int, tokens, start: int, num_logits: int) -> list[int]:
        return self._run("greedy", seq_id, tokens, start, num_logits)

    def forward_batch(self, items: list[BatchItem]) -> list:
        """Several sequences in one target call (backends.base.run_batch); after a
        device failure the batch is re-run on the replacement, ids mapped anew."""
        seqs = [self._seqs[i.seq_id] for i in items]
        for i in items:
            self._carried.pop(i.seq_id, None)
        out = self._guarded(lambda: run_batch(self.current, [
            BatchItem(s.inner, i.tokens, i.start, i.num_logits) for s, i in zip(seqs, items)]))
        for s, i in zip(seqs, items):
            s.wrote(i.start, i.tokens)
        return out

    def copy_prefix(self, src_id: int, dst_id: int, length: int) -> bool:
        """The live runner's copy_prefix; False (nothing copied, dst still empty) when the
        live runner cannot copy: a failover in the call may have moved to one that
        cannot, which is no device failure. dst replays as a prefill of the prefix."""
        src, dst = self._seqs[src_id], self._seqs[dst_id]

        def call() -> bool:
            if not self.current.can_copy_prefix:
                return False
            self.current.copy_prefix(src.inner, dst.inner, length)
            return True

        copied = self._guarded(call)
        if copied:
            dst.wrote(0, src.tokens()[:length])
        return copied

    def tokens(self, seq_id: int) -> list[int]:
        """The tokens whose KV the sequence holds, position by position."""
        return self._seqs[seq_id].tokens()

    def truncate(self, seq_id: int, length: int) -> None:
        s = self._seqs[seq_id]
        self._guarded(lambda: self.current.truncate(s.inner, length))
        s.cut(length)

    def length(self, seq_id: int) -> int:
        s = self._seqs[seq_id]
        return s.known + len(s.tail)

    def release(self, seq_id: int) -> None:
        s = self._seqs.pop(seq_id)
        self._carried.pop(seq_id, None)
        try:
            self.current.release(s.inner)
        except Exception as exc:  # the output is complete; a broken pool must not lose it
            self.events.append(f"target {where(self.current)} release failed: {describe(exc)}")

    def usage(self):
        return self.current.usage()

    def close(self) -> None:
        self.current.close()

    def _move(self, exc: BaseException) -> None:
        """Replace the failed runner and replay every live sequence into the new one."""
        original = failed = self.current
        self.events.append(f"target {where(failed)} failed: {describe(exc)}")
        while True:
            replacement = self.fallback.next_target(failed, exc)
            if replacement is None:
                raise GenerationError(f"the target on {where(failed)} failed ({describe(exc)}) and no other "
                                      "device can take it") from exc
            if self._layers and tuple(replacement.feature_layers) != self._layers:
                self.events.append(f"replacement {where(replacement)} cannot return the hidden states of "
                                   f"layers {list(self._layers)} (it returns {list(replacement.feature_layers)})")
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
        replayed = sum(self.length(seq_id) for seq_id in self._seqs)
        self.events.append(f"target moved to {where(replacement)}; {replayed} positions replayed")

    @staticmethod
    def _replay(runner: Runner, s: _Seq) -> int:
        new, tokens = runner.allocate(s.capacity), s.tokens()
        if tokens:
            runner.forward(new, tokens[:s.first], 0, 1)
        if len(tokens) > s.first:
            runner.forward(new, tokens[s.first:], s.first, len(tokens) - s.first)
        return new
