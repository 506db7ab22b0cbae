"""The hybrid drafter: suffix decoding where the text repeats, the EAGLE head elsewhere.

Each round the suffix drafter (cheap: a tree walk) drafts first. When its match
is long (>= min_match tokens of context seen before) and it proposes, its draft
goes; otherwise the head drafts. Both see every round's context (and the head
every round's target features, which it runs lazily with its next draft), so
either is ready the next round. The pick depends on the context and the suffix
trees alone, never on a random draw, so each round's q is its drafter's and
sampling stays exact; the adaptive draft length sees both as one drafter.
"""
from __future__ import annotations

import copy

from hetero_sd.drafting.base import Drafter
from hetero_sd.drafting.head import HeadDrafter
from hetero_sd.drafting.suffix import SuffixDrafter
from hetero_sd.ir.errors import ConfigError
from hetero_sd.ir.work import DraftRequest, DraftResult


class HybridDrafter(Drafter):
    name = "hybrid"

    def __init__(self, suffix: SuffixDrafter, head: HeadDrafter, min_match: int = 4):
        if min_match < 1:
            raise ConfigError(f"hybrid drafter: min_match must be >= 1, got {min_match}")
        self.suffix, self.head, self.min_match = suffix, head, min_match
        self.feature_layers = head.feature_layers
        self.picks = {"suffix": 0, "head": 0}  # rounds each drafter served (shown by benchmarks)

    def fork(self) -> "HybridDrafter":
        clone = copy.copy(self)  # (drafters are constructed in drafting.build alone)
        clone.suffix, clone.head, clone.picks = self.suffix.fork(), self.head.fork(), {"suffix": 0, "head": 0}
        return clone

    def begin(self, capacity: int, sampler=None, guide=None) -> None:
        self.suffix.begin(capacity, sampler, guide)
        self.head.begin(capacity, sampler, guide)

    def reset(self) -> None:
        self.suffix.reset()
        self.head.reset()

    def draft(self, req: DraftRequest) -> DraftResult:
        found = self.suffix.draft(DraftRequest(req.seq_id, req.base_len, req.k, req.new_tokens))
        if found.tokens and self.suffix.match_len >= self.min_match:
            # the head only takes in the round (k = 0): its features run with its next draft
            self.head.draft(DraftRequest(req.seq_id, req.base_len, 0, req.new_tokens, features=req.features))
            self.picks["suffix"] += 1
            return found
        self.picks["head"] += 1
        return self.head.draft(req)
