"""Whether greedy requests draft at all in this step of a batch: measured, per batch size.

The batch cost model (batch_cost.py) prices a draft row by a straight line fitted
over calls, which misses what a draft costs beside other sequences: the batched
attention pads every sequence to the longest step's rows, and drafting takes CPU
the call then lacks. So a policy that believes drafts pay can still lose
throughput in a large batch (measured: a batch of 16 at 0.88x of no drafting).
This gate measures instead. For each batch-size bucket (2, 3-4, 5-8, ...; the
server does not gate a request stepped alone, whose price is its own call's) it
keeps two arms, drafting on and off, each with the committed tokens and the step
seconds they took (discounted sums, so it follows a changing mix of prompts),
runs the better one, and now and then the other, so a change shows.

Only greedy requests are gated (any draft length leaves their output the
target's); a sampled request keeps its own policy, so its seed reproduces
whatever runs beside it. Deterministic: no clock or randomness inside; the
caller passes the seconds.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Arm:
    tokens: float = 0.0
    seconds: float = 0.0
    steps: int = 0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _Bucket:
    arms: dict = field(default_factory=lambda: {True: _Arm(), False: _Arm()})
    since_explore: int = 0


class SpeculationGate:
    """decide(batch) -> draft this step or not; observe(batch, drafted, tokens, seconds) after it.

    min_steps: steps each arm runs before the first choice; explore_every: the
    other arm runs once per this many steps, or per explore_rarely steps once one
    arm leads by `clear_lead` (a settled case costs little exploring); decay: the
    weight a step's figures keep per later step of the same arm."""

    def __init__(self, min_steps: int = 6, explore_every: int = 12, explore_rarely: int = 48,
                 clear_lead: float = 0.25, decay: float = 0.97):
        if min_steps < 1 or not 1 < explore_every <= explore_rarely or not 0 < decay <= 1:
            raise ValueError("need min_steps >= 1, 1 < explore_every <= explore_rarely and 0 < decay <= 1")
        self.min_steps, self.explore_every, self.explore_rarely = min_steps, explore_every, explore_rarely
        self.clear_lead, self.decay = clear_lead, decay
        self._buckets: dict[int, _Bucket] = {}

    @staticmethod
    def bucket(batch: int) -> int:
        """1, 2, 3-4, 5-8, 9-16, ...: the bucket's upper bound."""
        return 1 << max(0, batch - 1).bit_length()

    def _get(self, batch: int) -> _Bucket:
        return self._buckets.setdefault(self.bucket(batch), _Bucket())

    def decide(self, batch: int) -> bool:
        b = self._get(batch)
        on, off = b.arms[True], b.arms[False]
        if on.steps < self.min_steps or off.steps < self.min_steps:
            return on.steps <= off.steps  # both arms first, drafting first
        best = on.rate >= off.rate
        lead = max(on.rate, off.rate) / max(min(on.rate, off.rate), 1e-12) - 1
        every = self.explore_rarely if lead > self.clear_lead else self.explore_every
        b.since_explore += 1
        if b.since_explore >= every:
            b.since_explore = 0
            return not best
        return best

    def observe(self, batch: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A step of `batch` sequences, with greedy drafting on or off, committed
        `tokens` in `seconds` (its whole step: drafting, the call, accepting)."""
        arm = self._get(batch).arms[bool(drafted)]
        d = self.decay
        arm.tokens, arm.seconds, arm.steps = d * arm.tokens + tokens, d * arm.seconds + seconds, arm.steps + 1

    def state(self) -> dict[int, dict]:
        """Per bucket: each arm's tokens per second and steps (for /metrics and tests)."""
        return {k: {("on" if a else "off"): {"tok_s": arm.rate, "steps": arm.steps} for a, arm in b.arms.items()}
                for k, b in sorted(self._buckets.items())}
