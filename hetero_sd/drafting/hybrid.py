"""The hybrid drafter: suffix decoding where the text repeats, the EAGLE head (or a
draft model: `head` is any drafter) elsewhere.

Each round the suffix drafter (cheap: a tree walk) drafts first. When its match
is long (>= min_match tokens of context seen before) and it proposes, its draft
goes. Otherwise a draft model drafts (min_head_rate None), and a head drafts if
its drafts have lately been accepted at least `min_head_rate` of the time
(below that a draft's verify costs more than it brings: a head trained on
little data) and at least as often as the suffix
drafter's short-match drafts (running averages, both starting at 0.5); one
round in EXPLORE still tries the head, so a head that warms up to the text is
picked again. With neither, the round drafts nothing. Both see every round's context (and the
head every round's target features, which it runs lazily with its next
draft), so either is ready the next round. The pick depends on the context,
the suffix trees and earlier rounds' outcomes, never on this round's draws,
so each round's q is its drafter's and sampling stays exact; the adaptive
draft length sees both as one drafter.
"""
from __future__ import annotations

import copy

from hetero_sd.drafting.base import Drafter, round_of
from hetero_sd.drafting.suffix import SuffixDrafter
from hetero_sd.ir.errors import ConfigError
from hetero_sd.ir.work import DraftRequest, DraftResult
from hetero_sd.scheduler.round import Round


EXPLORE = 64  # one round in this many tries a head below the bar, to keep its average current
HEAD_MIN_RATE = 0.35  # a head's bar (min_head_rate); a draft model has none
GATE_START = {"head": 0.5, "short": 0.5}  # the running rates' start


class HybridDrafter(Drafter):
    name = "hybrid"
    can_fork = True

    def __init__(self, suffix: SuffixDrafter, head: Drafter, min_match: int = 4, min_head_rate: float | None = HEAD_MIN_RATE):
        """min_head_rate None: the head drafts in every round the suffix's match is short (a
        draft model, whose own min_prob decides how far it drafts; gating it by its running
        rate turned it off for good after one hard prompt)."""
        if min_match < 1:
            raise ConfigError(f"hybrid drafter: min_match must be >= 1, got {min_match}")
        self.suffix, self.head, self.min_match, self.min_head_rate = suffix, head, min_match, min_head_rate
        self.feature_layers = head.feature_layers
        self.picks = {"suffix": 0, "head": 0}  # rounds each drafter served (shown by benchmarks)
        # running acceptance of the head's drafts and of short-match suffix drafts (learnt per engine)
        self.rate = dict(GATE_START)
        self._last: str | None = None
        self._rounds = 0
        self._engine_gate = None  # (rate, rounds) set aside while a pinned request gates on its own

    def fork(self) -> "HybridDrafter":
        clone = copy.copy(self)  # (drafters are constructed in drafting.build alone)
        clone.suffix, clone.head, clone.picks = self.suffix.fork(), self.head.fork(), {"suffix": 0, "head": 0}
        # (the engine's rates, also while its own seeded request gates on fresh ones)
        rate, rounds = self._engine_gate or (self.rate, self._rounds)
        clone.rate, clone._rounds, clone._engine_gate, clone._last = dict(rate), rounds, None, None
        return clone

    def begin(self, capacity: int, sampler=None, guide=None) -> None:
        self._restore_gate()
        self.suffix.begin(capacity, sampler, guide)
        self.head.begin(capacity, sampler, guide)
        # A pinned request's picks decide how its random draws are used, so they must not
        # follow earlier requests: it gates on running rates of its own (scheduler/mode.py).
        if sampler is not None and sampler.mode.pinned:
            self._engine_gate = (self.rate, self._rounds)
            self.rate, self._rounds = dict(GATE_START), 0

    def _restore_gate(self) -> None:
        if self._engine_gate is not None:
            (self.rate, self._rounds), self._engine_gate = self._engine_gate, None

    def reset(self) -> None:
        self._restore_gate()
        self.suffix.reset()
        self.head.reset()

    def draft(self, req: DraftRequest, rnd: Round | None = None) -> DraftResult:
        rnd = round_of(rnd)
        found = self.suffix.draft(DraftRequest(req.seq_id, req.base_len, req.k, req.new_tokens, context=req.context),
                                  rnd)
        self._rounds += 1
        if found.tokens and self.suffix.match_len >= self.min_match:
            return self._skip_head(req, rnd, found, None)
        head = self.rate["head"]
        worth = self.min_head_rate is None or (
            head >= self.min_head_rate and (not found.tokens or head >= self.rate["short"]))
        if worth or self._rounds % EXPLORE == 0:
            self.picks["head"] += 1
            self._last = "head"
            return self.head.draft(req, rnd)
        return self._skip_head(req, rnd, found, "short")

    def _skip_head(self, req: DraftRequest, rnd: Round, found: DraftResult, kind: str | None) -> DraftResult:
        """The suffix drafter's proposal (maybe none); the head only takes in the round (k = 0):
        its features run with its next draft."""
        self.head.draft(DraftRequest(req.seq_id, req.base_len, 0, req.new_tokens, features=req.features,
                                     context=req.context))
        if found.tokens:
            self.picks["suffix"] += 1
            rnd.lookup = True  # microseconds: not what a head's or model's draft step costs
        self._last = kind if found.tokens else None
        return found

    def observe(self, drafted: int, accepted: int) -> None:
        """After a round: the acceptance of whichever drafter served it (the engine calls this)."""
        if self._last is not None and drafted:
            self.rate[self._last] += 0.1 * (accepted / drafted - self.rate[self._last])
