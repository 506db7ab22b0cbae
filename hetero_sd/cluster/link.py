"""What a placement across nodes costs per round: round trips over the link.

    cost = measure_link(actor, vocab)     # p50 / p99 of a control record and of a 5 x vocab block
    cost.per_round(sampled=True)          # what one drafting round pays for the link

A round with a drafter on another node sends one control record (the
DraftRequest) and gets one back (the DraftResult), and under sampling the
draft distributions: k rows of the vocabulary in float64. The probes make
the same trips through the same actor call path, so the figures include
Ray's scheduling of the call, serialisation and the object store.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from hetero_sd.ir.work import DraftRequest

BLOCK_ROWS = 5  # the "5 x vocab probability block": a k=5 draft's distributions
_blocks: dict[tuple[int, int], np.ndarray] = {}


def probe_reply(record: bytes, rows: int, vocab: int):
    """An actor's answer to a probe: the record, and a block made once per shape."""
    if rows == 0:
        return record, None
    block = _blocks.get((rows, vocab))
    if block is None:
        block = _blocks[(rows, vocab)] = np.full((rows, vocab), 1.0 / vocab)
    return record, block


@dataclass(frozen=True)
class LinkCost:
    control_p50: float  # seconds: one control record there and back
    control_p99: float
    block_p50: float  # seconds: a record there, a BLOCK_ROWS x vocab float64 block back
    block_p99: float
    probes: int

    def per_round(self, sampled: bool) -> float:
        """Seconds the link adds to one drafting round (median)."""
        return self.block_p50 if sampled else self.control_p50

    def describe(self) -> str:
        ms = lambda s: f"{s * 1e3:.2f} ms"  # noqa: E731
        return (f"control record p50 {ms(self.control_p50)} p99 {ms(self.control_p99)}; "
                f"{BLOCK_ROWS} x vocab probability block p50 {ms(self.block_p50)} p99 {ms(self.block_p99)} "
                f"({self.probes} probes each)")


def percentile(samples: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples), q))


def measure_link(actor, vocab: int, probes: int = 30) -> LinkCost:
    """Round trips to a Ray actor with a `probe` method (ray_drafter / ray_target)."""
    import ray

    record = DraftRequest(0, 0, BLOCK_ROWS, list(range(16))).pack()
    times: dict[int, list[float]] = {0: [], BLOCK_ROWS: []}
    ray.get(actor.probe.remote(record, BLOCK_ROWS, vocab), timeout=60)  # warm: the block is made once
    for _ in range(probes):
        for rows, got in times.items():
            t0 = time.perf_counter()
            ray.get(actor.probe.remote(record, rows, vocab), timeout=60)
            got.append(time.perf_counter() - t0)
    c, b = times[0], times[BLOCK_ROWS]
    return LinkCost(percentile(c, 50), percentile(c, 99), percentile(b, 50), percentile(b, 99), probes)


__all__ = ["BLOCK_ROWS", "LinkCost", "measure_link", "percentile", "probe_reply"]
