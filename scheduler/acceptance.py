"""Estimating per-token acceptance from what verification reports.

A round that drafted d tokens and had a accepted is a run of Bernoulli trials
that stops at the first rejection: a successes, plus one failure if a < d.
Its likelihood is alpha^a (1 - alpha)^[a < d], so over many rounds the
successes S and trials T are sufficient: the estimate is S / T, the Beta
posterior is Beta(a0 + S, b0 + T - S), and a confidence interval on S / T
tells whether an assumed alpha still fits. A round with no drafts (the n-gram
drafter found no match, or speculation is off) holds no trial at all, so it
is never counted as a rejection.
"""
from __future__ import annotations

import math


class AcceptanceTracker:
    """Discounted success/trial counts: every round with drafts first
    multiplies the old counts by `decay` (1.0 = remember everything; < 1 =
    evidence ages with newer evidence, so the estimate follows a text that
    changes character). Rounds without drafts do not age it: with an n-gram
    drafter that finds a match in one round out of ten, ageing by rounds would
    leave the estimate at its prior, however often the few drafts failed.
    A policy that switched speculation off calls age() each idle round, so
    old evidence fades back to the prior and a probe can turn it on again."""

    def __init__(self, decay: float = 1.0):
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.decay = decay
        self.reset()

    def reset(self) -> None:
        self.successes = 0.0
        self.trials = 0.0
        self.rounds = 0  # rounds with at least one draft, undiscounted
        # The same counts per draft position i (0-based): draft i is a trial
        # when every draft before it was accepted; positions past the drafts
        # are unobserved, not rejected.
        self.position_successes: list[float] = []
        self.position_trials: list[float] = []

    def observe(self, drafted: int, accepted: int) -> None:
        if not 0 <= accepted <= drafted:
            raise ValueError(f"need 0 <= accepted <= drafted, got accepted={accepted}, drafted={drafted}")
        if drafted == 0:
            return  # no drafts, no evidence either way
        self.age()
        self.successes += accepted
        self.trials += accepted + (1 if accepted < drafted else 0)
        self.rounds += 1
        count_positions(self.position_trials, self.position_successes, min(drafted, accepted + 1), accepted)

    def age(self) -> None:
        """One round's discount without evidence (speculation was off)."""
        d = self.decay
        self.successes *= d
        self.trials *= d
        self.position_successes = [x * d for x in self.position_successes]
        self.position_trials = [x * d for x in self.position_trials]

    def mean(self, prior_alpha: float = 0.5, prior_weight: float = 2.0) -> float:
        """Posterior mean of alpha under a Beta prior of that mean and weight."""
        a0 = prior_alpha * prior_weight
        return (a0 + self.successes) / (prior_weight + self.trials)

    def by_position(self, n: int, pooled: float, weight: float) -> tuple[float, ...]:
        """Acceptance of draft 1..n given the drafts before it were accepted,
        each shrunk toward the pooled estimate by `weight` pseudo-trials.
        A prompt-lookup drafter is bursty: its first draft fails often (the
        match was a coincidence), but once one is accepted the copied text
        tends to continue, so later positions accept more; a single alpha
        for all positions under-drafts exactly where drafting pays."""
        out = []
        for i in range(n):
            s = self.position_successes[i] if i < len(self.position_successes) else 0.0
            t = self.position_trials[i] if i < len(self.position_trials) else 0.0
            out.append((s + weight * pooled) / (t + weight))
        return tuple(out)

    def interval(self, z: float = 3.0) -> tuple[float, float]:
        """Wilson score interval for alpha ((0, 1) with no trials)."""
        n = self.trials
        if n <= 0:
            return 0.0, 1.0
        p = self.successes / n
        denom = 1 + z * z / n
        centre = (p + z * z / (2 * n)) / denom
        half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
        return max(0.0, centre - half), min(1.0, centre + half)

    def drifted_from(self, estimate: float, z: float = 3.0, min_trials: float = 32.0) -> bool:
        """"Far" from the estimate: enough trials, and the estimate outside the
        z-sigma Wilson interval of what was observed (z = 3: a false alarm in
        about 1 of 370 checks if trials were independent; drafts are not, so
        min_trials guards against a short streak)."""
        if self.trials < min_trials:
            return False
        low, high = self.interval(z)
        return not low <= estimate <= high


def count_positions(trials: list, successes: list, tried: int, accepted: int) -> None:
    """Per draft position i < tried: one more trial, and a success where i < accepted
    (the lists grow as needed, in place)."""
    grow = tried - len(trials)
    if grow > 0:
        trials += [0] * grow
        successes += [0] * grow
    for i in range(tried):
        trials[i] += 1
        successes[i] += i < accepted
