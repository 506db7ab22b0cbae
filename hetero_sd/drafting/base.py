"""The drafter contract: who proposes the tokens the target verifies.

Every drafter keeps its own view of the committed sequence, synchronised by
deltas (`DraftRequest.base_len` + `new_tokens`), so the same contract holds
when a drafter runs in another process (remote.py).

    required  name                              shown in stats and events
              begin(capacity, sampler, guide)   start a sequence
              draft(DraftRequest) -> DraftResult
              reset()                           forget the sequence (end of a request)
    optional  wait_ready()                      block until usable (a worker loading its model)
              close()                           free processes and memory for good
              observe(drafted, accepted)        after each speculative round: how its draft fared

Subclass `Drafter` to get the optional ones as no-ops.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from hetero_sd.ir.work import DraftRequest, DraftResult


class Drafter(ABC):
    name: str = "drafter"

    @abstractmethod
    def begin(self, capacity: int, sampler=None, guide=None) -> None:
        """Start a sequence of at most `capacity` positions (reserve what it needs).
        `sampler` (hetero_sd.sampling.Sampler) is None for greedy requests; a
        drafter that samples draws from its draft stream and returns the
        distributions in DraftResult.probs. `guide` (hetero_sd.constraint.guide.Guide)
        is the request's grammar, at the committed state whenever draft() is
        called; a drafter may draft within it (and must leave it as it found
        it) or ignore it: the engine cuts drafts the grammar refuses."""

    @abstractmethod
    def draft(self, req: DraftRequest) -> DraftResult:
        """Up to req.k tokens after the context the request describes (may be none)."""

    @abstractmethod
    def reset(self) -> None:
        """Forget the current sequence (called at the end of a request)."""

    def wait_ready(self) -> None:
        """Optional: block until the drafter can draft; raise why it cannot."""

    def close(self) -> None:
        """Optional: release what outlives a request (worker processes, runners)."""


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix: how much of a cache still matches a context."""
    n, limit = 0, min(len(a), len(b))
    while n < limit and a[n] == b[n]:
        n += 1
    return n


def apply_delta(context: list[int], req: DraftRequest) -> list[int]:
    """Roll `context` back to req.base_len tokens and append req.new_tokens (in place)."""
    if req.base_len > len(context):
        raise ValueError(f"draft request base_len {req.base_len} beyond known {len(context)} tokens")
    del context[req.base_len:]
    context.extend(req.new_tokens)
    return context
