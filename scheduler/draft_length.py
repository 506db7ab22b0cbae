"""How far ahead to draft: a policy fed with each round's record.

The contract is DraftLengthPolicy (scheduler/round.py): `next_k`, `observe(Round)`,
`reset`, `set_cost(RoundCost)` (the cost of a round as a batching server prices
it; a fixed k prices drafts by it only), `draft_prices()` and `frozen()`. The
request calls `next_k(remaining)` before each speculative round and
`observe(round)` after its verify: round.drafted is how many drafts the target
actually verified (the n-gram drafter may return fewer than asked, or none),
round.accepted how many of them it kept, and its timings what the drafter and
the verify took (catch_up_s: the part of the draft's that took in context it
had not drafted, which does not price later draft steps). Both policies learn
costs from those timings alike (LearntCosts). Policies are deterministic
functions of the rounds: no clock, no randomness inside. They are plain data a
deep copy duplicates: a batching server gives each request a copy, and a pinned
request (scheduler/mode.py) drafts by `frozen()`.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace

from hetero_sd.ir.work import MAX_DRAFT_TOKENS, DraftPrices
from hetero_sd.scheduler.acceptance import AcceptanceTracker
from hetero_sd.scheduler.cost_model import CostCurve, RoundCost
from hetero_sd.scheduler.round import Round


REPRICE_EVERY = 4  # rounds between a fixed k's draft prices


class LearntCosts:
    """What a policy learns from rounds' timings, the same for every policy: the verify
    and draft cost curves (OnlineCurve) and the achieved rate (AchievedRate)."""

    _verify: "OnlineCurve"
    _draft: "OnlineCurve"
    _rate: "AchievedRate"
    # Of the rounds of requests that draft during verifies (Round.overlapped), the share whose
    # drafts a verify hid (a pre-draft hit): their drafting costs no critical time, so the
    # draft curve prices the rest only (scheduler/overlap.py round_seconds)
    _hidden: float = 0.0

    def _learn(self, rnd: Round, draft_steps: int) -> bool:
        """Learn from the round's timings (draft_steps: the draft steps its draft time
        covers); True when its verify was timed."""
        if rnd.overlapped:
            self._hidden += OVERLAP_SMOOTHING * ((1.0 if rnd.predrafted else 0.0) - self._hidden)
        draft_s, verify_s = rnd.priced_draft_s, rnd.timed_verify_s
        if draft_s is not None and draft_steps > 0:
            observe_draft(self._draft, draft_steps, draft_s, rnd.catch_up_s)
        if verify_s is None:
            return False
        self._verify.observe(rnd.drafted + 1, verify_s)
        self._rate.observe(rnd.accepted + 1, round_seconds(verify_s, draft_s, rnd.catch_up_s, self._draft.step_s()),
                           self._verify(1))
        return True

    def _draft_snapshot(self, n_max: int) -> CostCurve:
        """The draft curve as a round pays it: a verify hides the share _hidden of drafts."""
        curve = self._draft.snapshot(n_max)
        if self._hidden <= 0:
            return curve
        return CostCurve(tuple((n, s * (1.0 - self._hidden)) for n, s in curve.points))


OVERLAP_SMOOTHING = 0.2


@dataclass
class FixedDraftLength(LearntCosts):
    """Always propose k tokens (bounded by what is left to generate). It learns what
    rounds cost from their timings only to price drafts (draft_prices) for a draft
    model that stops where drafts no longer pay (min_prob: auto); k itself never moves."""

    k: int
    cost: RoundCost | None = None  # the prior (a measured profile); DEFAULT_COST without one

    def __post_init__(self):
        if not 1 <= self.k <= MAX_DRAFT_TOKENS:
            raise ValueError(f"k must be in 1..{MAX_DRAFT_TOKENS}, got {self.k}")
        self._rate = AchievedRate()
        self.set_cost(self.cost or DEFAULT_COST)

    def next_k(self, remaining: int) -> int:
        return max(0, min(self.k, remaining))

    def observe(self, rnd: Round) -> None:
        """Acceptance does not change k; the timings price the next rounds' drafts
        (a draft model's round makes about one draft step per proposed draft)."""
        self._learn(rnd, rnd.drafted)
        self._rounds += 1
        if self._rounds % REPRICE_EVERY == 0:  # (costs move slowly; pricing is ~50 us)
            self._prices = None

    def frozen(self) -> "FixedDraftLength":
        return FixedDraftLength(self.k, self.cost)

    def reset(self) -> None:
        """A new request: costs are the placement's and are kept."""

    def set_cost(self, cost: RoundCost) -> None:
        """What a round costs now (a batching server's price): only drafts' prices follow it."""
        self._verify, self._draft, self._prices = OnlineCurve(cost.verify), OnlineCurve(cost.draft), None
        self._rounds = 0

    def draft_prices(self) -> DraftPrices:
        if self._prices is None:
            self._prices = RoundCost(self._verify.snapshot(self.k + 1), self._draft_snapshot(self.k)).prices(self.k)
        return priced(self._prices, self._rate)


def observe_draft(curve: "OnlineCurve", steps: int, draft_s: float, catch_up_s: float) -> None:
    """Price a round's draft steps by its draft time, less the first call where it took
    in context the drafter had not drafted (Round.catch_up_s: a one-off, the
    first draft step inside it); a round that was all catch-up prices nothing."""
    if catch_up_s > 0:
        steps, draft_s = steps - 1, max(0.0, draft_s - catch_up_s)
    if steps > 0:
        curve.observe(steps, draft_s)


class AchievedRate:
    """The tokens speculation has made per decode step's time over the last rounds
    (DraftPrices.rate): a ratio of moving averages (tokens per round over a round's
    seconds in decode steps), at least 1, the rate of decoding alone; 1 until a round
    is timed. It prices a draft's time: a policy that maximises tokens per second
    (not tokens less seconds) must ask more of a draft the better speculation goes.
    Kept across requests, as costs are (a few rounds move it)."""

    def __init__(self, smoothing: float = 0.2):
        self.smoothing = smoothing
        self._tokens = self._steps = None

    def observe(self, tokens: int, seconds: float, step_s: float) -> None:
        if not (step_s > 0 and math.isfinite(seconds) and seconds >= 0):
            return
        steps, s = seconds / step_s, self.smoothing
        if self._tokens is None:
            self._tokens, self._steps = float(tokens), steps
        else:
            self._tokens += s * (tokens - self._tokens)
            self._steps += s * (steps - self._steps)

    @property
    def value(self) -> float:
        if not self._steps:
            return 1.0
        return max(1.0, self._tokens / self._steps)


def priced(prices: DraftPrices, rate: AchievedRate) -> DraftPrices:
    return replace(prices, rate=rate.value)


def round_seconds(verify_s: float, draft_s: float | None, catch_up_s: float, step_s: float) -> float:
    """A round's seconds as the achieved rate counts them: without a draft model's catch-up
    (its prompt, a copy it did not draft), a one-off that would drag the rate to 1 for
    the first rounds of every request; but with the first draft step, which the catch-up's
    call made too (step_s: a draft step's seconds)."""
    if catch_up_s <= 0:
        return verify_s + (draft_s or 0.0)
    return verify_s + max(0.0, (draft_s or 0.0) - catch_up_s) + step_s


# Without a measured profile: a cheap drafter, and a verify costing 10% of a
# decode more per extra token (measured 3-28% on a 2-core CPU host). Only
# the shape matters: timings passed to observe() rescale it to seconds.
DEFAULT_COST = RoundCost(verify=CostCurve(((1, 1.0), (2, 1.1))), draft=CostCurve.affine(0.0, 0.02))


class OnlineCurve:
    """A cost curve learnt from timings, as prior(n) x level x shape(n).

    level: the factor every size shares (it turns a relative prior into
    seconds and follows costs that grow with the context). shape(n): what the
    prior got wrong about size n alone (e.g. a jump between widths 4 and 5).

    Timings on a shared machine are noisy and heavy-tailed (another process
    takes the core for a few ms), so the learning is robust, in log space:
    a size's shape starts as the median of its first `min_obs` residuals (one
    spike cannot brand a width as slow for the whole run) and then moves
    slowly; every update is clipped to `clip` (a spike moves the level by at
    most smoothing x clip), so only persistent changes move the curve. Each
    timing updates the level by what it says once the size's shape is
    divided out, then the shape by what is left, so sitting at one size
    never rescales the others' shapes. Sizes whose prior is 0 keep a clipped
    moving average of their own.
    """

    def __init__(self, prior: CostCurve, smoothing: float = 0.25, min_obs: int = 3, clip: float = 0.3):
        self.prior, self.smoothing, self.min_obs, self.clip = prior, smoothing, min_obs, clip
        self.level: float | None = None  # log
        self.shape: dict[int, float] = {}  # log
        self.count: dict[int, int] = {}
        self.first: dict[int, list[float]] = {}  # residuals until a size has min_obs of them
        self.raw: dict[int, float] = {}
        self._prior: dict[int, float] = {}  # prior(n), computed once per size

    def _base(self, n: int) -> float:
        base = self._prior.get(n)
        if base is None:
            base = self._prior[n] = self.prior(n)
        return base

    def _step(self, error: float, rate: float) -> float:
        return rate * min(self.clip, max(-self.clip, error))

    def observe(self, n: int, seconds: float) -> None:
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"a timing must be finite seconds >= 0, got {seconds}")
        s, base = self.smoothing, self._base(n)
        self.count[n] = self.count.get(n, 0) + 1
        if base <= 0:
            old = self.raw.get(n)
            self.raw[n] = seconds if old is None else old * math.exp(
                self._step(math.log(max(seconds, 1e-9) / max(old, 1e-9)), s))
            return
        y = math.log(max(seconds, 1e-9) / base)
        if self.level is None:
            self.level = y
        if n in self.shape and n not in self.first:  # established: level first, then shape slowly
            self.level += self._step(y - self.shape[n] - self.level, s)
            self.shape[n] += self._step(y - self.level - self.shape[n], s / 4)
            return
        first = self.first.setdefault(n, [])
        first.append(y - self.level)
        self.shape[n] = statistics.median(first)
        if len(first) >= self.min_obs:
            del self.first[n]

    def step_s(self) -> float:
        """Seconds of size 1 once any size was timed (the prior alone is no seconds), else 0."""
        return self(1) if self.level is not None else 0.0

    def seen(self, n: int) -> bool:
        return self.count.get(n, 0) >= self.min_obs

    def __call__(self, n: int) -> float:
        base = self._base(n)
        if base <= 0:
            return self.raw.get(n, 0.0)
        level = 0.0 if self.level is None else self.level
        return base * math.exp(level + self.shape.get(n, 0.0))

    def snapshot(self, n_max: int) -> CostCurve:
        """The curve on 1..n_max, made non-decreasing (a wider verify or a longer
        draft never costs less): a size timed rarely and noisily is pooled with
        its neighbours, weighted by how often each was timed, so one lucky
        timing cannot make k = 8 look cheaper than k = 7."""
        values = [self(n) for n in range(1, n_max + 1)]
        weights = [1.0 + self.count.get(n, 0) for n in range(1, n_max + 1)]
        return CostCurve(tuple(zip(range(1, n_max + 1), _non_decreasing(values, weights))))


def _non_decreasing(values: list[float], weights: list[float]) -> list[float]:
    """Weighted least-squares non-decreasing fit (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight, size]
    for v, w in zip(values, weights):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, n2 = blocks.pop()
            m1, w1, n1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return [m for m, _, size in blocks for _ in range(size)]


class AdaptiveDraftLength(LearntCosts):
    """Acceptance-driven k in 0..k_max, per request.

    alpha: the posterior mean of a Beta(prior) over per-token acceptance, with
    counts discounted by `decay` each round, so it follows a prompt
    that turns from grounded to open-ended. Decisions use the acceptance of
    each draft position given the ones before it (`acceptance()`), shrunk
    toward alpha by `position_weight` pseudo-trials: n-gram drafts are bursty
    (a first draft often fails, a continued copy rarely does), which one
    alpha for every position misjudges. Costs: `cost` (a measured profile,
    or a relative default) corrected online by the timings given to observe().
    Each round it picks the k maximising expected tokens per second
    (cost_model.RoundCost.best_k); k = 0 switches speculation off. While off it
    probes every `probe_every` rounds with the k that an optimistic (upper
    confidence) acceptance would choose, at least 1; a probe that fails
    doubles the interval (up to `max_probe_every`), one that turns
    speculation back on resets it. While on and fed timings, every
    `explore_every`-th round tries the nearest k whose costs it has not seen
    yet (once per k, kept across requests), so a cost the prior got wrong at
    some width is found rather than assumed.
    """

    def __init__(self, k_max: int, cost: RoundCost | None = None, *, prior_alpha: float = 0.6,
                 prior_weight: float = 4.0, decay: float = 0.95, probe_every: int = 8,
                 max_probe_every: int = 64, explore_every: int = 8, hit_smoothing: float = 0.1,
                 position_weight: float = 4.0, redecide_every: int = 4):
        if not 1 <= k_max <= MAX_DRAFT_TOKENS:
            raise ValueError(f"k_max must be in 1..{MAX_DRAFT_TOKENS}, got {k_max}")
        self._built = dict(k_max=k_max, cost=cost, prior_alpha=prior_alpha, prior_weight=prior_weight, decay=decay,
                           probe_every=probe_every, max_probe_every=max_probe_every, explore_every=explore_every,
                           hit_smoothing=hit_smoothing, position_weight=position_weight,
                           redecide_every=redecide_every)  # (frozen())
        if not 0 < prior_alpha < 1 or prior_weight <= 0 or not 1 <= probe_every <= max_probe_every:
            raise ValueError("need 0 < prior_alpha < 1, prior_weight > 0 and 1 <= probe_every <= max_probe_every")
        self.k_max = k_max
        self.prior_alpha, self.prior_weight = prior_alpha, prior_weight
        self.base_probe_every, self.max_probe_every, self.hit_smoothing = probe_every, max_probe_every, hit_smoothing
        self.explore_every, self.position_weight = explore_every, position_weight
        self.redecide_every = redecide_every
        self._timed = False  # timings have been observed: exploring costs teaches something
        prior = cost or DEFAULT_COST
        self._verify, self._draft = OnlineCurve(prior.verify), OnlineCurve(prior.draft)
        self._rate = AchievedRate()
        self._acceptance = AcceptanceTracker(decay)
        self.reset()

    def reset(self) -> None:
        """A new request: acceptance and the n-gram hit rate start over; costs are
        properties of the placement and are kept."""
        self._acceptance.reset()
        self.hit_rate = 1.0
        self.probe_every = self.base_probe_every
        self._off_rounds = self._on_rounds = 0
        self._probe_tries = 0  # > 0 while a probe waits for a round that has drafts
        self._choice: int | None = None  # cached decision; None = recompute
        self._prices: DraftPrices | None = None  # cached with the decision
        self._stale = 0  # rounds since the cached decision was made

    def frozen(self) -> "AdaptiveDraftLength":
        """The policy as constructed: its prior costs, nothing learnt."""
        return AdaptiveDraftLength(**self._built)

    @property
    def alpha(self) -> float:
        return self._acceptance.mean(self.prior_alpha, self.prior_weight)

    def acceptance(self) -> tuple[float, ...]:
        """Per-position acceptance (AcceptanceTracker.by_position) around the pooled alpha."""
        return self._acceptance.by_position(self.k_max, self.alpha, self.position_weight)

    def round_cost(self) -> RoundCost:
        return RoundCost(self._verify.snapshot(self.k_max + 1), self._draft_snapshot(self.k_max))

    def set_cost(self, cost: RoundCost) -> None:
        """Replace the cost curves (what was learnt about them is dropped; acceptance
        is kept): a batching server prices a request's rows by the batch it runs in."""
        self._verify, self._draft = OnlineCurve(cost.verify), OnlineCurve(cost.draft)
        self._choice = None  # decide again with the new prices

    def _decide(self) -> int:
        if self._choice is None:
            cost = self.round_cost()
            self._choice = cost.best_k(self.acceptance(), self.k_max, self.hit_rate)[0]
            self._prices, self._stale = cost.prices(self.k_max), 0
        return self._choice

    def draft_prices(self) -> DraftPrices:
        """The costs the latest decision was made with (DraftPrices)."""
        self._decide()
        return priced(self._prices, self._rate)

    def _probe_k(self) -> int:
        """The k an optimistic acceptance (2-sigma upper bound, prior included) would pick."""
        tr = self._acceptance
        n = tr.trials + self.prior_weight
        p = (tr.successes + self.prior_alpha * self.prior_weight) / n
        upper = min(1.0, p + 2.0 * math.sqrt(p * (1 - p) / n))
        return max(1, self.round_cost().best_k(upper, self.k_max, self.hit_rate)[0])

    def _explore_k(self, k: int) -> int:
        """The k nearest to the chosen one (smaller first) whose verify or draft
        cost is still unseen, 0 included (a plain decode is the baseline every
        k is compared with); k itself when every k has been seen."""
        unseen = [j for j in range(0, self.k_max + 1)
                  if not self._verify.seen(j + 1) or (j > 0 and not self._draft.seen(j))]
        return min(unseen, key=lambda j: (abs(j - k), j)) if unseen else k

    def next_k(self, remaining: int) -> int:
        if remaining <= 0:
            return 0
        k = self._decide()
        if k > 0:
            self._off_rounds = 0
            self._on_rounds += 1
            if self._timed and self._on_rounds % self.explore_every == 0:
                k = self._explore_k(k)
        else:
            self._off_rounds += 1
            if self._probe_tries or self._off_rounds >= self.probe_every:
                k = self._probe_k()
                self._probe_tries += 1
        return min(k, remaining)

    def observe(self, rnd: Round) -> None:
        drafted, accepted = rnd.drafted, rnd.accepted
        asked = max(rnd.asked, drafted)
        self._acceptance.observe(drafted, accepted)  # validates; a round without drafts is no evidence
        if asked == 0:  # speculation off: let old evidence fade so a probe can turn it back on
            self._acceptance.age()
        if asked > 0:  # how often the drafter finds anything (n-gram misses)
            self.hit_rate += self.hit_smoothing * ((1.0 if drafted else 0.0) - self.hit_rate)
        if self._learn(rnd, asked):
            self._timed = True
        # Re-decide on new acceptance evidence, else every `redecide_every`
        # rounds: most rounds of an open-ended prompt find no n-gram match and
        # only nudge the costs and the hit rate, and deciding afresh each time
        # cost ~1% of a 17 ms round (measured) for the same answer.
        self._stale += 1
        if drafted > 0 or self._stale >= self.redecide_every:
            self._choice = None
        if self._probe_tries and (drafted > 0 or self._probe_tries >= 4):
            self._end_probe()

    def _end_probe(self) -> None:
        on = self._decide() > 0
        self.probe_every = self.base_probe_every if on else min(2 * self.probe_every, self.max_probe_every)
        self._probe_tries, self._off_rounds = 0, 0
