"""One round's record, and the contract of the policy that reads it.

A round flows one way: the request starts the record when it proposes, the
drafter fills its part while it drafts, the request completes it when it
accepts, and the draft-length policy reads it (`observe`). Nothing flows
back into the drafter or the request from it.

    field        filled by                         read by
    asked        Request.propose (policy.next_k)   AdaptiveDraftLength.observe
    free_rows    Request.propose                   drafters (a padded call's free row)
    prices       Request.propose (draft_prices)    a draft model's stop rule (min_prob: auto)
    draft_s      Request.propose (around draft)    policy.observe (draft cost), the batch server
    catch_up_s   the drafter                       policy.observe (a one-off not priced)
    lookup       the drafter (a hybrid's lookup)   Request.accept (no draft step to price)
    drafted      Request.propose                   policy.observe, Drafter.observe
    accepted     Request.accept                    policy.observe, Drafter.observe
    verify_s     Request.accept                    policy.observe (verify cost, achieved rate)
    learnt       Request.accept                    policy.observe (timings taught or not)
    overlapped   Request.propose                   policy.observe (the request drafts during verifies)
    predrafted   Request.propose (a pre-draft hit)  policy.observe (drafts that cost no critical time)

Plain numbers, so a record crosses to a worker's reply header as numbers
(drafting/wire.py carries catch_up_s).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from hetero_sd.ir.work import DraftPrices


@dataclass
class Round:
    asked: int = 0  # the k the policy asked for (before the room left caps it)
    free_rows: int = 0  # the first drafts ride in rows the target computes anyway (backends/row_check.py)
    prices: DraftPrices | None = None  # what a draft's row and step cost; None: no prices (sampled, or unknown)
    draft_s: float | None = None  # seconds the drafter took; None: nothing drafted, or a failover in the call
    catch_up_s: float = 0.0  # of draft_s, the call that took in context the drafter had not drafted
    lookup: bool = False  # the drafts came from a lookup inside a drafter that also runs a model
    drafted: int = 0  # drafts the target verified
    accepted: int = 0  # of them, accepted
    verify_s: float | None = None  # the verify's seconds (a batched call's share)
    learnt: bool = True  # the policy learns costs from its timings (not in a failover, nor a pinned request)
    overlapped: bool = False  # the request pre-drafts each next round during the verify (scheduler/overlap.py)
    predrafted: bool = False  # its drafts were pre-drafted during the last verify (draft_s is then 0)

    @property
    def priced_draft_s(self) -> float | None:
        """The draft seconds that price draft steps: none for a lookup's round (microseconds,
        not what a model's draft step costs), a pre-drafted one (a serial draft's cost is
        what a miss pays) or an untaught one."""
        return None if self.lookup or self.predrafted or not self.learnt else self.draft_s

    @property
    def timed_verify_s(self) -> float | None:
        return self.verify_s if self.learnt else None


class DraftLengthPolicy(Protocol):
    """How far ahead to draft (scheduler/draft_length.py has the two policies).

    next_k(remaining)   the drafts to ask for this round (remaining: tokens still
                        wanted beyond the free recovered or bonus one)
    observe(round)      after the verify of a speculative round (Round)
    reset()             a new request: acceptance starts over, learnt costs are kept
    set_cost(cost)      what a round costs now (a batching server's RoundCost)
    draft_prices()      DraftPrices for a draft model's stop rule, None without costs
    frozen()            a copy that drafts by the policy as constructed (no learnt costs,
                        acceptance of its own): what a pinned request drafts by (mode.py)

    Policies are deterministic functions of the rounds they observe: no clock, no
    randomness inside.
    """

    def next_k(self, remaining: int) -> int: ...

    def observe(self, rnd: Round) -> None: ...

    def reset(self) -> None: ...

    def set_cost(self, cost) -> None: ...

    def draft_prices(self) -> DraftPrices | None: ...

    def frozen(self) -> "DraftLengthPolicy": ...
