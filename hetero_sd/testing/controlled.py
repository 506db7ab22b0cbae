"""A drafter of controlled acceptance and declared cost, for benchmarks of the overlap.

It knows the target's greedy continuation of the prompt (an oracle computed
target-only beforehand) and drafts each of its tokens with probability `a`, a
random token otherwise, sleeping `step_s` per draft token as a draft model's
step would take. Its per-token acceptance is then about `a` whatever the model,
so a benchmark sets acceptance and draft cost exactly (issue 58's GPU check:
a = 0.5, 0.7, 0.9). A testing utility, never built from a config.
"""
from __future__ import annotations

import time

import numpy as np

from hetero_sd.drafting.base import Drafter
from hetero_sd.ir.work import DraftRequest, DraftResult


class ControlledDrafter(Drafter):
    name = "controlled"
    can_fork = False

    def __init__(self, prompt: list[int], oracle: list[int], vocab: int, a: float, step_s: float = 0.0,
                 seed: int = 0, device: str = "cpu"):
        """oracle: the target's greedy output after `prompt`; device: where it declares it drafts."""
        self.prompt, self.oracle, self.vocab = list(prompt), list(oracle), vocab
        self.a, self.step_s, self.seed, self._device = a, step_s, seed, device
        self.calls = 0

    @property
    def draft_device(self) -> str:
        return self._device

    def begin(self, capacity: int, sampler=None, guide=None) -> None:
        self.forget_context()

    def reset(self) -> None:
        self.forget_context()

    def draft(self, req: DraftRequest, rnd=None) -> DraftResult:
        """Position p's draft is the oracle's token when a coin seeded by (seed, p) falls
        under a and every token before it is the oracle's; a random one otherwise. A
        function of the context alone: a pre-draft and a serial draft of it agree."""
        context = list(self.context_for(req))
        self.calls += 1
        start = len(context) - len(self.prompt)
        on_path = context[len(self.prompt):] == self.oracle[:start]
        tokens = []
        for p in range(start, start + req.k):
            rng = np.random.default_rng([self.seed, p])
            known = on_path and p < len(self.oracle)
            token = self.oracle[p] if known and rng.random() < self.a else int(rng.integers(self.vocab))
            on_path = known and token == self.oracle[p]
            tokens.append(token)
        if self.step_s > 0:
            time.sleep(self.step_s * req.k)
        return DraftResult(req.seq_id, tokens)


__all__ = ["ControlledDrafter"]
