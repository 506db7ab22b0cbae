"""Draft-length policies: the fixed one, the acceptance tracker, the adaptive one
on synthetic acceptance and cost streams."""
from __future__ import annotations

import random

import pytest

from hetero_sd.scheduler import (AcceptanceTracker, AdaptiveDraftLength, CostCurve, FixedDraftLength, Round,
                                 RoundCost)

# A verify costs 10 ms plus 1 ms per extra token; drafting 0.2 ms per token.
TRUE = RoundCost(CostCurve(tuple((w, 0.010 + 0.001 * (w - 1)) for w in range(1, 18))), CostCurve.affine(0.0, 2e-4))
# Verify is expensive: width 2 already costs 1.6 decodes.
COSTLY = RoundCost(CostCurve(((1, 0.010), (2, 0.016), (17, 0.060))), CostCurve.affine(0.0, 2e-4))


def run(policy, alpha_of_round, rounds, seed=0, truth=TRUE, hit=1.0, timings=True):
    """Drive a policy like the engine does; return the k asked in each round."""
    rng, asked = random.Random(seed), []
    for r in range(rounds):
        k = policy.next_k(10_000)
        drafted = k if rng.random() < hit else 0  # an n-gram miss drafts nothing
        accepted = 0
        while accepted < drafted and rng.random() < alpha_of_round(r):
            accepted += 1
        if timings:
            policy.observe(Round(asked=k, drafted=drafted, accepted=accepted,
                                 draft_s=truth.draft(k) if k else None, verify_s=truth.verify(drafted + 1)))
        else:
            policy.observe(Round(asked=k, drafted=drafted, accepted=accepted))
        asked.append(k)
    return asked


def test_fixed_policy_accepts_timings_and_stays_fixed():
    policy = FixedDraftLength(4)
    policy.observe(Round(drafted=4, accepted=0, draft_s=0.01, verify_s=0.02))
    policy.reset()
    assert [policy.next_k(r) for r in (10, 4, 2, 0, -1)] == [4, 4, 2, 0, 0]
    with pytest.raises(ValueError):
        FixedDraftLength(0)


def test_tracker_counts_bernoulli_trials_and_skips_empty_rounds():
    t = AcceptanceTracker()
    t.observe(5, 2)  # 2 accepted, the third rejected: 3 trials
    t.observe(3, 3)  # all accepted: 3 trials, no failure
    t.observe(0, 0)  # no drafts (n-gram miss): no trial at all
    assert (t.successes, t.trials, t.rounds) == (5, 6, 2)
    low, high = t.interval(2.0)
    assert 0 < low < 5 / 6 < high <= 1
    with pytest.raises(ValueError):
        t.observe(2, 3)


def test_tracker_estimate_and_interval_cover_the_truth():
    rng, covered = random.Random(5), 0
    for trial in range(100):
        t, alpha = AcceptanceTracker(), rng.uniform(0.1, 0.9)
        for _ in range(60):
            a = 0
            while a < 4 and rng.random() < alpha:
                a += 1
            t.observe(4, a)
        low, high = t.interval(3.0)
        covered += low <= alpha <= high
        assert not t.drifted_from(alpha, z=5.0)
    assert covered >= 97  # a 3-sigma interval misses rarely


def test_tracker_decay_follows_a_change():
    t = AcceptanceTracker(decay=0.9)
    for _ in range(100):
        t.observe(4, 4)
    for _ in range(40):
        t.observe(4, 0)
    assert t.successes / t.trials < 0.1 and t.drifted_from(0.9, min_trials=5)


def test_tracker_counts_each_draft_position():
    tr = AcceptanceTracker()
    tr.observe(4, 2)  # drafts 1, 2 accepted, 3 rejected, 4 never judged
    tr.observe(1, 1)
    tr.observe(0, 0)  # no drafts: nothing
    assert tr.position_trials == [2, 1, 1] and tr.position_successes == [2, 1, 0]
    assert tr.by_position(4, pooled=0.5, weight=1.0) == pytest.approx((2.5 / 3, 0.75, 0.25, 0.5))


def test_adaptive_drafts_long_for_bursty_acceptance():
    """Prompt lookup on grounded text: the first draft is a coin flip, but once one
    is accepted the copied text continues (each later draft 95%). A single alpha
    (about 0.7 here) under-drafts; per-position acceptance finds the long k."""
    def true_tokens(k):
        return 1 + sum(0.5 * 0.95 ** (j - 1) for j in range(1, k + 1))

    rates = {k: true_tokens(k) / (TRUE.verify(k + 1) + (TRUE.draft(k) if k else 0)) for k in range(9)}
    best = max(rates.values())
    assert max(rates, key=rates.get) == 8
    rng, policy, asked = random.Random(7), AdaptiveDraftLength(8), []
    for _ in range(600):
        k = policy.next_k(10_000)
        accepted = 0
        if k and rng.random() < 0.5:
            accepted = 1
            while accepted < k and rng.random() < 0.95:
                accepted += 1
        policy.observe(Round(asked=k, drafted=k, accepted=accepted, draft_s=TRUE.draft(k) if k else None,
                             verify_s=TRUE.verify(k + 1)))
        asked.append(k)
    late = asked[-300:]
    assert sum(rates[k] for k in late) / len(late) >= 0.95 * best
    h = policy.acceptance()
    assert h[0] < 0.65 and min(h[1:4]) > 0.8  # it sees the burst


@pytest.mark.parametrize("alpha", [0.3, 0.6, 0.8, 0.9])
def test_adaptive_converges_to_the_best_k(alpha):
    policy = AdaptiveDraftLength(16)  # no prior cost: the timings teach it
    asked = run(policy, lambda r: alpha, 600, seed=int(alpha * 100))
    best_k, best_rate, _ = TRUE.best_k(alpha, 16)
    assert best_k > 0
    late = asked[-300:]
    # its k's are worth >= 95% of the optimum on average, and the most frequent one is within 2 of it
    assert sum(TRUE.rate(alpha, k) for k in late) / len(late) >= 0.95 * best_rate
    assert abs(max(set(late), key=late.count) - best_k) <= 2


def test_adaptive_learns_a_cost_jump_from_timings():
    # Widths above 4 cost double (OpenVINO's compressed weights jump between 4 and 5 tokens).
    jump = RoundCost(CostCurve(((1, 0.010), (4, 0.012), (5, 0.024), (17, 0.030))), CostCurve.affine(0.0, 1e-4))
    assert jump.best_k(0.9, 8)[0] == 3
    policy = AdaptiveDraftLength(8, cost=RoundCost(CostCurve(((1, 0.010), (9, 0.012)))))  # prior: no jump
    late = run(policy, lambda r: 0.9, 400, truth=jump)[-200:]
    assert max(set(late), key=late.count) == 3


def test_adaptive_turns_off_and_back_on():
    # A pessimistic prior: evidence fading back to it never turns speculation on; only probes can.
    policy = AdaptiveDraftLength(8, cost=COSTLY, prior_alpha=0.3)
    assert COSTLY.best_k(0.3, 8)[0] == 0 and COSTLY.best_k(0.9, 8)[0] > 0
    asked = run(policy, lambda r: 0.0 if r < 400 else 0.9, 700, truth=COSTLY)
    off = asked[100:400]
    assert sum(k == 0 for k in off) >= 0.9 * len(off)  # off while nothing is accepted
    probes = sum(k > 0 for k in off)
    assert 1 <= probes <= 12  # it keeps probing, sparsely (the interval backs off)
    back = asked[400:]
    first_on = next(i for i in range(len(back) - 10) if all(k > 0 for k in back[i:i + 10]))
    assert first_on <= 150  # speculation returns with the acceptance
    assert min(back[-100:]) >= 3


def test_adaptive_does_not_count_empty_rounds_as_rejections():
    policy = AdaptiveDraftLength(8)
    asked = run(policy, lambda r: 1.0, 300, hit=0.5)  # half the rounds find no n-gram match
    assert policy.alpha > 0.9
    assert asked[-1] == 8 and policy.hit_rate < 0.8


def test_adaptive_bounds_and_validation():
    policy = AdaptiveDraftLength(3)
    asked = run(policy, lambda r: 1.0, 100)
    assert set(asked) <= {0, 1, 2, 3} and asked[-1] == 3
    assert policy.next_k(2) == 2 and policy.next_k(0) == 0 and policy.next_k(-5) == 0
    for bad in (0, 17):
        with pytest.raises(ValueError):
            AdaptiveDraftLength(bad)
    with pytest.raises(ValueError):
        policy.observe(Round(drafted=1, accepted=0, verify_s=-1.0))


def test_adaptive_is_deterministic_and_reset_forgets_acceptance_only():
    a, b = AdaptiveDraftLength(8), AdaptiveDraftLength(8)
    assert run(a, lambda r: 0.7, 200, seed=3) == run(b, lambda r: 0.7, 200, seed=3)
    gone = run(a, lambda r: 0.0, 200, seed=4)[-100:]
    assert sum(k > 0 for k in gone) <= 30  # nothing accepted: mostly off (k = 1 now and then re-checks)
    learnt = a.round_cost().verify(5)
    a.reset()
    assert a.alpha == pytest.approx(0.6) and a.hit_rate == 1.0  # back to the prior
    assert a.round_cost().verify(5) == learnt  # costs belong to the placement: kept
    assert a.next_k(100) > 0


def test_adaptive_without_timings_uses_the_given_cost():
    # Same acceptance, two cost models: a costly verify keeps k shorter.
    cheap = run(AdaptiveDraftLength(16, cost=TRUE), lambda r: 0.8, 300, timings=False)[-100:]
    dear = run(AdaptiveDraftLength(16, cost=COSTLY), lambda r: 0.8, 300, timings=False)[-100:]
    assert sum(dear) < sum(cheap)


def test_rare_matches_still_teach_acceptance():
    """An n-gram drafter that matches one round in ten, and whose drafts mostly fail:
    the estimate must follow those few drafts, not fade back to an optimistic prior
    between them (rounds without drafts are no evidence, and no reason to forget)."""
    flat = RoundCost(CostCurve(((1, 0.010), (17, 0.011))), CostCurve.affine(0.0, 1e-5))  # drafts almost free
    policy = AdaptiveDraftLength(8, cost=flat, prior_alpha=0.7)
    asked = run(policy, lambda r: 0.3, 600, hit=0.1, seed=3, truth=flat)
    assert sum(k == 0 for k in asked[100:]) < 100  # drafting stays on (k = 0 only as exploration)
    assert policy.alpha < 0.5 and policy.acceptance()[0] < 0.45  # near the true 0.3, not the prior 0.7


def test_one_spiky_timing_does_not_brand_a_width_as_slow():
    """A shared machine: the first timing of the best width is 5x (another process
    took the core). The curve's first estimate of a width is a median, and later
    updates are clipped, so the best k is still found."""
    alpha = 0.6
    best_k = TRUE.best_k(alpha, 8)[0]
    assert best_k == 3
    spiked = {best_k + 1}  # verify width of the best k: its first timing only

    class Spiky:
        def __init__(self):
            self.draft = TRUE.draft

        def verify(self, width):
            if width in spiked:
                spiked.discard(width)
                return 5 * TRUE.verify(width)
            return TRUE.verify(width)

    policy = AdaptiveDraftLength(8)
    late = run(policy, lambda r: alpha, 500, seed=5, truth=Spiky())[-200:]
    assert not spiked  # the spike happened
    assert late.count(best_k) >= 0.6 * len(late)  # (a curve that kept the spike never chose 3 again)


def test_noisy_timings_still_give_a_non_decreasing_curve_near_the_best_k():
    rng = random.Random(11)

    class Noisy:
        def __init__(self):
            self.draft = TRUE.draft

        def verify(self, width):
            return TRUE.verify(width) * rng.lognormvariate(0.0, 0.3)

    policy = AdaptiveDraftLength(8)
    late = run(policy, lambda r: 0.75, 800, seed=6, truth=Noisy())[-300:]
    curve = policy.round_cost().verify
    assert all(curve(w) <= curve(w + 1) for w in range(1, 9))  # a wider verify never looks cheaper
    best_rate = TRUE.best_k(0.75, 8)[1]
    assert sum(TRUE.rate(0.75, k) for k in late) / len(late) >= 0.93 * best_rate


def _drive_with_a_backlog(report_catch_up: bool) -> list[int]:
    """A 0.5B drafting for a 1.5B here: a draft step 7 ms, a verify 16 ms + 2.5 ms a row,
    95% acceptance. The draft model's first round takes in a 120-token prompt, and a round
    after rounds without drafts takes in the tokens committed meanwhile, each in the call
    that makes its first draft (Round.catch_up_s)."""
    policy, rng, asked, behind = AdaptiveDraftLength(8), random.Random(0), [], 120
    step = 0.007
    for _ in range(80):
        k = policy.next_k(10_000)
        accepted = 0
        while accepted < k and rng.random() < 0.95:
            accepted += 1
        draft_s = catch_up = None
        if k:
            catch_up = 0.002 * behind + step if behind > 2 else 0.0
            draft_s, behind = catch_up + step * (k - (1 if catch_up else 0)), 0
        else:
            behind += 1
        policy.observe(Round(asked=k, drafted=k, accepted=accepted, draft_s=draft_s, verify_s=0.016 + 0.0025 * k,
                             catch_up_s=(catch_up or 0.0) if report_catch_up else 0.0))
        asked.append(k)
    return asked


def test_a_catch_up_does_not_price_draft_steps():
    """Priced as draft steps, the prompt's catch-up made a draft step look 5 times dearer:
    k: auto turned drafting off, and each probe's own catch-up kept it off (measured on
    the Qwen pair: 4 drafts in 128 tokens). Left out of the price, it drafts on."""
    fair = _drive_with_a_backlog(True)
    assert fair.count(0) <= 8 and sum(fair) / len(fair) >= 2, fair
    trapped = _drive_with_a_backlog(False)  # the trap is real: the same stream, catch-up priced
    assert trapped.count(0) >= 40, trapped
