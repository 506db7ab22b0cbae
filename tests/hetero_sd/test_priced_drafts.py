"""min_prob: auto (drafting/model.DraftStop): a greedy draft model's round stops where
a draft's chance of acceptance (the product of the draft's own probabilities) no
longer pays for its verify row, priced in decode steps by the policy's costs
(RoundCost.prices), which a fixed k learns from the rounds' timings too.

Lossless: the target decides every token whatever is proposed; checked for the same
and another tokenizer, every k from 1 to 8, three price levels, and a draft's time
priced at twice the rate of decoding alone (DraftPrices.rate, the rate speculation
achieves). The rule itself is checked draft by draft, and that dear rows (or a
higher rate) take fewer drafts than cheap ones."""
from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from hetero_sd.drafting import ModelDrafter
from hetero_sd.drafting.cross_vocab import CrossVocabDrafter
from hetero_sd.drafting.model import DraftStop
from hetero_sd.engine import Engine
from hetero_sd.ir.work import DraftPrices, DraftRequest
from hetero_sd.scheduler import AdaptiveDraftLength, FixedDraftLength, Round
from hetero_sd.scheduler.draft_length import AchievedRate
from hetero_sd.scheduler.cost_model import CostCurve, RoundCost
from helpers.table_model import TableRunner

from helpers.table_model import letter_bridge as _bridge

PROMPT = [0, 1, 2, 0, 1]

CHEAP = RoundCost(CostCurve(((1, 1.0), (9, 1.0))), CostCurve.affine(0.0, 0.01))  # rows free, drafts ~free
MIDDLE = RoundCost(CostCurve(((1, 1.0), (2, 1.3), (9, 3.4))), CostCurve.affine(0.0, 0.1))
DEAR = RoundCost(CostCurve(((1, 1.0), (2, 1.45), (9, 6.0))), CostCurve.affine(0.0, 0.2))


def _request(prices: DraftPrices | None, free: int = 0) -> Round:
    return Round(asked=4, free_rows=free, prices=prices)


def test_prices_are_each_row_and_a_draft_step_in_decode_steps():
    cost = RoundCost(CostCurve(((1, 2.0), (2, 2.4), (3, 3.2))), CostCurve.affine(0.0, 0.5))
    prices = cost.prices(3)
    assert prices.rows == pytest.approx((0.2, 0.4, 0.4))  # the last beyond the curve: its last slope
    assert prices.step == pytest.approx(0.25)


def test_the_stop_rule_draft_by_draft():
    prices = DraftPrices((0.2, 0.4, 0.4), 0.1)
    stop = DraftStop(None, _request(prices))
    assert stop.needs_prob
    assert stop.take(0, 0.9) == (True, True)  # 0.9 pays row 0, and row 1 plus a step (0.5)
    assert stop.take(1, 0.5) == (True, False)  # chance 0.45 pays row 1 (0.4), not row 2 + a step
    assert DraftStop(None, _request(prices)).take(0, 0.3) == (True, False)
    assert DraftStop(None, _request(prices)).take(0, 0.1) == (False, False)
    assert DraftStop(None, _request(prices, free=1)).take(0, 0.1) == (True, False)  # a free row takes it
    # a fixed min_prob keeps its rule; auto without prices (a policy that knows no costs) drafts to k
    assert DraftStop(0.5, _request(prices)).take(0, 0.4) == (False, False)
    assert DraftStop(0.5, _request(prices, free=1)).take(0, 0.4) == (True, False)
    assert DraftStop(0.5, _request(prices)).take(0, 0.6) == (True, True)
    unpriced = DraftStop(None, _request(None))
    assert not unpriced.needs_prob and unpriced.take(0, 1.0) == (True, True)


def test_the_stop_rule_prices_a_draft_at_the_achieved_rate():
    """At rate 2 (speculation makes two tokens a decode step's time) every cost counts
    twice: 0.9 still pays row 0 (0.4) but no longer row 1 and a step (1.0)."""
    rated = DraftPrices((0.2, 0.4, 0.4), 0.1, rate=2.0)
    assert DraftStop(None, _request(rated)).take(0, 0.9) == (True, False)
    assert DraftStop(None, _request(rated)).take(0, 0.3) == (False, False)  # (rate 1: proposed)
    assert DraftStop(None, _request(rated, free=1)).take(0, 0.3) == (True, False)  # a free row is free at any rate
    assert DraftStop(0.5, _request(rated)).take(0, 0.6) == (True, True)  # a fixed min_prob ignores prices


def test_the_achieved_rate_is_tokens_per_decode_step_and_never_below_one():
    rate = AchievedRate(smoothing=0.2)
    assert rate.value == 1.0  # nothing timed yet: decoding alone
    for _ in range(40):  # 3 tokens a round in 1.5 steps' time
        rate.observe(3, 0.015, 0.010)
    assert rate.value == pytest.approx(2.0)
    rate.observe(3, float("nan"), 0.010)
    rate.observe(3, 0.015, 0.0)  # (untimed rounds teach nothing)
    assert rate.value == pytest.approx(2.0)
    for _ in range(40):  # rounds slower than decoding: the rate of decoding alone, not less
        rate.observe(1, 0.030, 0.010)
    assert rate.value == 1.0


@pytest.mark.parametrize("make", [lambda: FixedDraftLength(4), lambda: AdaptiveDraftLength(4)], ids=["fixed", "auto"])
def test_a_policy_prices_drafts_at_the_rate_its_rounds_achieve(make):
    policy = make()
    assert policy.draft_prices().rate == 1.0
    for _ in range(60):  # a plain round (1 token, 10 ms), then 4 tokens in 20 ms + 6 ms of drafts
        policy.observe(Round(drafted=0, accepted=0, verify_s=0.010))
        policy.observe(Round(drafted=3, accepted=3, draft_s=0.006, verify_s=0.020))
    # about (1 + 4) / 2 tokens over (1 + 2.6) / 2 steps a round (moving averages: approx)
    assert policy.draft_prices().rate == pytest.approx(2.5 / 1.8, rel=0.1)
    before = policy.draft_prices().rate
    # a new request's first round: the draft model takes in its prompt (0.4 s, 40 steps) with
    # its first draft; that one-off is no price of the rounds to come
    policy.observe(Round(drafted=3, accepted=3, draft_s=0.402, verify_s=0.020, catch_up_s=0.4))
    assert policy.draft_prices().rate >= 0.9 * before


def test_a_fixed_k_prices_drafts_by_the_timings_it_observes():
    policy = FixedDraftLength(4)
    before = policy.draft_prices()  # the prior (DEFAULT_COST): a row 0.1 step, a draft step 0.02
    for _ in range(30):  # a verify of 2 rows as dear as 1.5 steps, a draft step 0.2 of one
        policy.observe(Round(drafted=0, accepted=0, verify_s=0.010))
        policy.observe(Round(drafted=1, accepted=1, draft_s=0.002, verify_s=0.015))
    prices = policy.draft_prices()
    assert before.rows[0] == pytest.approx(0.1) and before.step == pytest.approx(0.02)
    # (learnt robustly, so slowly: a spike moves a curve's shape by little)
    assert prices.rows[0] == pytest.approx(0.5, rel=0.1) and prices.step == pytest.approx(0.2, rel=0.1)
    assert policy.next_k(10) == 4  # k itself never moves


@dataclass
class _Rated(FixedDraftLength):
    """A fixed k whose prices carry a given achieved rate (the engine feeds no timings here)."""

    rate: float = 1.0

    def draft_prices(self) -> DraftPrices:
        return replace(super().draft_prices(), rate=self.rate)


def _run(target, drafter, k: int, cost: RoundCost, rate: float = 1.0) -> object:
    engine = Engine(target, drafter, policy=_Rated(k, cost, rate))
    req = engine.request(PROMPT, 30, learn_timings=False)  # the prices stay the given ones
    req.run()
    return req.close()


@pytest.mark.parametrize("cross", [False, True], ids=["same-vocab", "cross-vocab"])
def test_priced_drafts_are_lossless_and_follow_the_price(cross):
    target = TableRunner(4, seed=0)
    alone = Engine(target, None).generate_ids(PROMPT, 30).token_ids
    drafted = {}
    for name, cost, rate in (("cheap", CHEAP, 1.0), ("middle", MIDDLE, 1.0), ("middle, rate 2", MIDDLE, 2.0),
                             ("dear", DEAR, 1.0)):
        for k in range(1, 9):
            draft = TableRunner(4, seed=3, scale=1.0)
            drafter = CrossVocabDrafter(draft, _bridge(), None) if cross else ModelDrafter(draft, 4, min_prob=None)
            res = _run(target, drafter, k, cost, rate)
            assert res.token_ids == alone, (name, k)
            drafted[name, k] = res.stats.drafted
    for k in range(1, 9):
        assert drafted["cheap", k] >= drafted["middle", k] >= drafted["dear", k], (k, drafted)
        assert drafted["middle", k] >= drafted["middle, rate 2", k], (k, drafted)
    assert sum(drafted["middle", k] for k in range(1, 9)) > sum(drafted["middle, rate 2", k] for k in range(1, 9))
    assert sum(drafted["cheap", k] for k in range(1, 9)) > sum(drafted["dear", k] for k in range(1, 9)) > 0, drafted


def test_min_prob_auto_in_a_config(tmp_path):
    from hetero_sd.config import load_config
    from hetero_sd.errors import ConfigError
    from hetero_sd.spec import spec_from_config

    path = tmp_path / "c.yaml"
    path.write_text("drafter: {kind: model, model: default, min_prob: auto, k: 6}\n")
    assert spec_from_config(load_config(path)).drafter.min_prob is None
    path.write_text("drafter: {kind: model, model: default, min_prob: sometimes}\n")
    with pytest.raises(ConfigError, match="min_prob"):
        load_config(path)


class _TimedTable(TableRunner):
    """A table model whose calls take 2 ms a token fed, as a real model's prefill would."""

    def forward(self, seq_id, tokens, start, num_logits):
        import time
        time.sleep(0.002 * len(tokens))
        return super().forward(seq_id, tokens, start, num_logits)


@pytest.mark.parametrize("cross", [False, True], ids=["same-vocab", "cross-vocab"])
def test_a_draft_model_reports_the_catch_up_apart_from_its_draft_steps(cross):
    """The first round takes in the prompt with its first draft: that call's seconds are
    Round.catch_up_s. A round after a drafted one feeds its last draft and the bonus
    and reports none, as does a round after a lookup's short copy (<= CATCH_UP tokens)."""
    from hetero_sd.drafting.model import CATCH_UP

    draft = _TimedTable(4, seed=3, scale=1.0)
    drafter = CrossVocabDrafter(draft, _bridge(), min_prob=0.0) if cross else ModelDrafter(draft, 4, min_prob=0.0)
    drafter.begin(256)
    prompt = [0, 1, 2] * 8  # 24 tokens
    first_round, steady_round, behind_round = Round(), Round(), Round()
    first = drafter.draft(DraftRequest(0, 0, 3, prompt, context=prompt), first_round)
    assert len(first.tokens) == 3
    assert first_round.catch_up_s >= 0.002 * len(prompt), first_round  # (the prompt's call: 2 ms a token)
    ctx = prompt + first.tokens + [0]  # all accepted, and a bonus token
    steady = drafter.draft(DraftRequest(0, len(prompt), 3, ctx[len(prompt):], context=ctx), steady_round)
    assert len(steady.tokens) == 3 and steady_round.catch_up_s == 0.0
    ctx2 = ctx + steady.tokens[:1] + [1] * (CATCH_UP + 6)  # one accepted, then a copy the drafter did not draft
    drafter.draft(DraftRequest(0, len(ctx), 3, ctx2[len(ctx):], context=ctx2), behind_round)
    assert behind_round.catch_up_s >= 0.002 * (CATCH_UP + 1), behind_round  # (fewer across tokenizers)


def test_the_request_hands_the_catch_up_to_the_policy():
    """The engine passes each round's catch-up to the policy beside the draft's seconds,
    and the output stays the target's."""
    from hetero_sd.scheduler import AdaptiveDraftLength

    target = TableRunner(4, seed=0)
    prompt = [0, 1, 2] * 8
    alone = Engine(target, None).generate_ids(prompt, 20).token_ids
    policy, seen = AdaptiveDraftLength(4), []
    observe = policy.observe

    def spy(rnd):
        seen.append((rnd.drafted, rnd.draft_s, rnd.catch_up_s))
        observe(rnd)

    policy.observe = spy
    engine = Engine(target, ModelDrafter(_TimedTable(4, seed=3, scale=1.0), 4), policy=policy)
    assert engine.generate_ids(prompt, 20).token_ids == alone
    drafted = [(d, s, c) for d, s, c in seen if d]
    assert drafted[0][2] >= 0.002 * len(prompt) and drafted[0][1] >= drafted[0][2], drafted
    assert all(c <= s for _, s, c in drafted), drafted  # (a part of the round's draft seconds)
