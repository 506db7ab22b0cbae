"""How a request's target rows become what its accept step takes.

A Scorer holds what shapes a request's rows: its penalties, its grammar
(a Constrainer), its sampler (None: greedy), and the log-probabilities it
reports. `score(logits, ...)` gives greedy ids or the sampler's float64
distributions, and keeps the rows' log-probabilities for `record`, which
notes each committed token's entry (GenerationResult.logprobs).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hetero_sd.sampling import Sampler, SamplingParams, penalize


@dataclass
class TokenLogprob:
    """A committed token's log-probability under the target's distribution for its
    position, after the request's sampling warps and grammar mask (the distribution
    it was decided from), and the `top` most likely (token, log-probability) pairs."""
    token: int
    logprob: float
    top: list[tuple[int, float]]


class Scorer:
    def __init__(self, sampler: Sampler | None, penalties: SamplingParams | None, logprobs: int | None):
        self.sampler = sampler
        self.penalties = penalties  # SamplingParams whose penalties apply to every row scored (None: none)
        self.constrainer = None  # hetero_sd.constraint.rounds.Constrainer when the output has a grammar
        # logprobs: None, or how many top alternatives each committed token reports with its
        # own log-probability; the rows of the latest scored call, as log-probabilities
        self.top = logprobs
        self.entries: list[TokenLogprob] | None = [] if logprobs is not None else None
        self._rows: np.ndarray | None = None

    @property
    def plain(self) -> bool:
        """Greedy ids are the target's argmax alone (the runner's greedy call serves them)."""
        return self.constrainer is None and self.sampler is None and self.top is None and self.penalties is None

    def score(self, logits, history, drafts: list[int]):
        """Greedy ids, or float64 distributions when sampling, from the target's logits
        for a step's rows (history: the request's TokenHistory; drafts: the step's)."""
        if self.penalties is not None:  # (the history is copied only where penalties read it)
            logits = penalize(logits, self.penalties, history.ids[:history.prompt_len], history.output, drafts)
        if self.constrainer is not None:
            logits = self.constrainer.apply(logits)
        if self.sampler is None:
            if self.top is not None:
                self._rows = _log_softmax(logits)
            return [int(i) for i in logits.argmax(-1)]
        probs = self.sampler.probs(logits)
        if self.top is not None:
            with np.errstate(divide="ignore"):  # a token the warps removed: log 0 = -inf
                self._rows = np.log(probs)
        return probs

    def record(self, row: int, token: int) -> None:
        """Note token `token`'s entry from row `row` of the latest scored call (the row that decided it)."""
        if self.entries is None:
            return
        lp = self._rows[row]
        top = []
        if self.top:
            best = np.argpartition(-lp, self.top - 1)[:self.top]
            best = best[np.lexsort((best, -lp[best]))]  # most likely first; ties by id
            top = [(int(t), float(lp[t])) for t in best]
        self.entries.append(TokenLogprob(int(token), float(lp[token]), top))


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-probabilities of float32 logits rows (a masked -inf stays -inf)."""
    x = logits.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


__all__ = ["Scorer", "TokenLogprob"]
