"""Who runs next: a bounded waiting queue ordered by priority, FIFO within a
priority, with ageing so a low priority still runs under a steady stream of
higher ones (no starvation).

A waiting request's effective priority is its priority plus the seconds it has
waited divided by `ageing_s`: after `ageing_s` seconds it ranks with requests
one priority above it. Pure bookkeeping: the server decides what "fits".
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class QueueFull(Exception):
    """The waiting queue is at its bound; `retry_after` is a guess in seconds."""

    def __init__(self, size: int, retry_after: float):
        super().__init__(f"the waiting queue is full ({size} requests); retry in {retry_after:.0f} s")
        self.size, self.retry_after = size, retry_after


@dataclass
class _Entry(Generic[T]):
    item: T
    priority: float
    arrived: float
    order: int = field(default=0)


class AdmissionQueue(Generic[T]):
    def __init__(self, max_waiting: int, ageing_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        if max_waiting < 1 or ageing_s <= 0:
            raise ValueError("need max_waiting >= 1 and ageing_s > 0")
        self.max_waiting, self.ageing_s, self._clock = max_waiting, ageing_s, clock
        self._entries: list[_Entry[T]] = []
        self._order = itertools.count()
        self.served_s = 1.0  # recent seconds per admitted request, for Retry-After

    def __len__(self) -> int:
        return len(self._entries)

    def push(self, item: T, priority: float = 0.0) -> None:
        if len(self._entries) >= self.max_waiting:
            raise QueueFull(len(self._entries), max(1.0, self.served_s * len(self._entries)))
        self._entries.append(_Entry(item, priority, self._clock(), next(self._order)))

    def push_front(self, item: T, priority: float, arrived: float) -> None:
        """Put back an item popped but not admitted, keeping its place (may exceed the bound by one)."""
        self._entries.append(_Entry(item, priority, arrived, -next(self._order)))

    def _rank(self, e: _Entry[T], now: float) -> tuple[float, int]:
        return (e.priority + (now - e.arrived) / self.ageing_s, -e.order)

    def pop(self) -> tuple[T, float, float] | None:
        """The next item to run, with its priority and arrival time; None when empty."""
        if not self._entries:
            return None
        now = self._clock()
        best = max(self._entries, key=lambda e: self._rank(e, now))
        self._entries.remove(best)
        return best.item, best.priority, best.arrived

    def remove(self, pred: Callable[[T], bool]) -> list[T]:
        """Take out every waiting item `pred` selects (cancelled requests)."""
        gone = [e.item for e in self._entries if pred(e.item)]
        self._entries = [e for e in self._entries if not pred(e.item)]
        return gone

    def drain(self) -> list[T]:
        items, self._entries = [e.item for e in self._entries], []
        return items
