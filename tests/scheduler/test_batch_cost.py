"""The batch cost model: a call's fixed and per-row seconds learnt from
timings, and the per-request price that turns speculation down in big batches."""
from __future__ import annotations

import random

import pytest

from hetero_sd.scheduler import AdaptiveDraftLength, Round
from hetero_sd.scheduler.batch_cost import BatchCost


def test_fit_recovers_fixed_and_per_row_from_noisy_timings():
    cost, rng = BatchCost(), random.Random(0)
    for _ in range(300):
        rows = rng.randint(1, 60)
        cost.observe(rows, (0.012 + 0.002 * rows) * rng.uniform(0.95, 1.05))
    fixed, per_row = cost.fit()
    assert fixed == pytest.approx(0.012, rel=0.2) and per_row == pytest.approx(0.002, rel=0.1)


def test_constant_rows_fall_back_to_the_prior_shape_scaled():
    cost = BatchCost(prior_fixed=1.0, prior_per_row=0.1)
    assert cost.fit() == (1.0, 0.1)
    for _ in range(5):
        cost.observe(4, 0.028)
    fixed, per_row = cost.fit()
    assert fixed + 4 * per_row == pytest.approx(0.028) and fixed / per_row == pytest.approx(10.0)


def test_share_and_draft_length_shrink_as_the_batch_grows():
    cost = BatchCost()
    for rows in range(1, 80):
        cost.observe(rows, 0.010 + 0.0015 * rows)
    assert cost.share(3, 1) > cost.share(3, 8) > cost.share(3, 32)
    for pattern, off_at_32 in (((4, 2),), False), (((4, 1), (4, 0), (4, 1)), True):
        chosen = []
        for batch in (1, 4, 16, 32):
            policy = AdaptiveDraftLength(8)
            for _ in range(10):
                for drafted, accepted in pattern:
                    policy.observe(Round(drafted=drafted, accepted=accepted))
            policy.set_cost(cost.round_cost(batch, draft_s_per_token=1e-5))
            chosen.append(policy.next_k(100))
        assert chosen[0] >= 1 and chosen == sorted(chosen, reverse=True) and chosen[-1] < chosen[0], chosen
        assert (chosen[-1] == 0) == off_at_32, chosen
