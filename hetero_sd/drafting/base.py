"""The drafter contract: who proposes the tokens the target verifies.

A drafter drafts after the context a DraftRequest describes. In process the
request carries that context (`DraftRequest.context`: the request's one token
history, read, never copied); a drafter in another process is sent the delta
(`base_len` + `new_tokens`) and `context_for` rebuilds the sequence there.

    required  name                              shown in stats and events
              begin(capacity, sampler, guide)   start a sequence
              draft(DraftRequest, Round) -> DraftResult
                                                (the round's record, scheduler/round.py: it reads
                                                free_rows and prices, fills catch_up_s and lookup)
              reset()                           forget the sequence (end of a request)
    optional, declared here with their defaults (never probed for):
              can_fork + fork()                 an independent drafter for another concurrent
                                                sequence (the batching server); False: it cannot
              takes_guide                       begin() takes the request's grammar (True; False
                                                for a drafter written to the contract before
                                                guides: it is begun without one)
              feature_layers                    target layers whose hidden states it reads (a head)
              model_free                        drafting is a lookup of microseconds (n-gram,
                                                suffix), so a draft in a row the target computes
                                                anyway (a padded one-token call) costs nothing
              one_hot                           its drafts never carry a distribution (probs None:
                                                q one-hot), so a seeded sample's output is
                                                target-only sampling's whatever it drafts
                                                (hetero_sd/sampling.py)
              runner                            what it drafts with in this process: a
                                                backends.base.Runner for a draft model, a head
                                                runner for a head; None when model-free or in
                                                another process. A re-plan after the failure of
                                                a Runner excludes its device
              draft_device                      where it computes: its runner's device, "cpu" (the
                                                host) for a lookup or a worker on the host; the
                                                overlap (scheduler/overlap.py) compares it with
                                                the target's
              predrafts                         it can draft round r+1 before round r's verify
                                                returns (False for a head: it reads that verify's
                                                hidden states); it must then take a request whose
                                                context is rolled back (base_len) past tokens it
                                                was told before
              observe(drafted, accepted)        after each speculative round: how its draft fared
              wait_ready()                      block until usable (a worker loading its model)
              close()                           free processes and memory for good
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

from hetero_sd.ir.work import DraftRequest, DraftResult
from hetero_sd.scheduler.round import Round


class Drafter(ABC):
    name: str = "drafter"
    can_fork: bool = False
    takes_guide: bool = True
    feature_layers: tuple[int, ...] = ()
    model_free: bool = False
    one_hot: bool = False
    runner = None  # (see the module docstring)
    _view: Sequence[int] | None = None  # the context of the latest request (context_for)
    _owns_view = False

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
    def draft(self, req: DraftRequest, rnd: Round | None = None) -> DraftResult:
        """Up to req.k tokens after the context the request describes (may be none).
        rnd: the round's record, whose drafter's part this fills (None: a call outside a
        round, as a test or a worker's drafting ahead makes: `round_of` gives a blank one)."""

    @abstractmethod
    def reset(self) -> None:
        """Forget the current sequence (called at the end of a request)."""

    @property
    def draft_device(self) -> str:
        """Where it computes (module docstring)."""
        device = getattr(self.runner, "device", None)
        return device.device if device is not None and hasattr(device, "device") else "cpu"

    @property
    def predrafts(self) -> bool:
        """Whether it can draft before the verify returns (module docstring)."""
        return not self.feature_layers

    def fork(self) -> "Drafter":
        """Optional (can_fork): a drafter for another concurrent sequence."""
        raise NotImplementedError(f"drafter {self.name} cannot serve concurrent sequences (can_fork is False)")

    def observe(self, drafted: int, accepted: int) -> None:
        """Optional: after a speculative round, how many of its drafts were accepted."""

    def wait_ready(self) -> None:
        """Optional: block until the drafter can draft; raise why it cannot."""

    def close(self) -> None:
        """Optional: release what outlives a request (worker processes, runners)."""

    # ------------------------------------------------------------ the context
    def context_for(self, req: DraftRequest) -> Sequence[int]:
        """The context to draft after: the request's own (in process, no copy), or,
        for a request that carries only the delta (made by hand, or decoded from
        the wire), this drafter's view rolled back and extended by it."""
        if req.context is not None:
            self._view, self._owns_view = req.context, False
            return req.context
        if not self._owns_view:
            self._view, self._owns_view = [], True
        return apply_delta(self._view, req)

    @property
    def context(self) -> Sequence[int]:
        """The context of the latest request ([] after reset)."""
        return self._view if self._view is not None else []

    @context.setter
    def context(self, tokens: list[int]) -> None:  # a drafter that keeps its own list
        self._view, self._owns_view = tokens, True

    def forget_context(self) -> None:
        self._view, self._owns_view = None, False


def round_of(rnd: Round | None) -> Round:
    """The round a draft call fills (a blank one for a call outside a round)."""
    return rnd if rnd is not None else Round()


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
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
