"""How a request stands to the requests before and beside it: decided once, in Engine.request.

The rule (seeded reproducibility). A sampled request that gives a seed must
draw the same tokens whatever ran before it or runs beside it. Its tokens
follow from the seed and from where its draws are used, and with drafts that
carry a distribution (a draft model's, a head's) the draft lengths and the
drafts decide where: so everything that shapes them must be the request's own.
A **pinned** request (seeded, sampled, drafting with distributions) therefore

- drafts by the policy as constructed (`policy.frozen()`): acceptance of its
  own, no costs learnt from other requests, and it teaches no timings;
- is not priced by a batching server (no batch cost), nor given a padded
  call's free row (only greedy requests are: `greedy`);
- drafts from its own suffix tree and the shipped corpus, never the outputs
  of earlier requests (`shares_lookups` False), and a hybrid drafter gates its
  lookups on rates of its own (drafting/hybrid.py).

Drafts that never carry a distribution (n-gram, suffix alone: one-hot q) leave
a seeded output equal to target-only sampling's whatever they propose
(hetero_sd/sampling.py), so a seeded request with such a drafter is not pinned.
Any seeded request is kept from the re-planner (`replans` False): a re-plan
could swap its one-hot drafter for one with distributions mid-request.

A **concurrent** request (the batching server's) drafts with a fork of the
drafter and a copy of the policy, priced by the batch (it teaches no timings
of its own). The sampler carries the request's mode to the drafters that read
it (`Sampler.mode`).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestMode:
    greedy: bool = True
    seeded: bool = False  # sampled with a seed: it must reproduce
    one_hot: bool = False  # the drafter's drafts never carry a distribution
    concurrent: bool = False  # runs beside others (the batching server)
    timed: bool = True  # its timings may teach the policy costs (False: the caller fixes the prices)

    @classmethod
    def of(cls, greedy: bool, seed: int | None, one_hot: bool, concurrent: bool = False,
           timed: bool = True) -> "RequestMode":
        return cls(greedy, seed is not None and not greedy, one_hot, concurrent, timed)

    @property
    def pinned(self) -> bool:
        """Its drafting must follow nothing but its own rounds (module docstring)."""
        return self.seeded and not self.one_hot

    @property
    def own_policy(self) -> bool:
        """It drafts by a policy of its own: a copy, or for a pinned one `frozen()`."""
        return self.concurrent or self.pinned

    @property
    def learns_timings(self) -> bool:
        """Its rounds' timings teach the policy costs (alone, and not pinned; beside
        others the batch cost model prices rounds)."""
        return self.timed and not self.concurrent and not self.pinned

    @property
    def priced(self) -> bool:
        """A batching server prices its rounds by the batch (RoundCost), and a padded
        one-token call's free row may carry its draft."""
        return self.greedy

    @property
    def replans(self) -> bool:
        """Its rounds feed the re-planner, which may swap its drafter."""
        return not self.seeded

    @property
    def shares_lookups(self) -> bool:
        """It may draft from what earlier requests produced (a suffix drafter's global tree)."""
        return not self.pinned


FREE = RequestMode()  # a greedy request alone: nothing pinned
