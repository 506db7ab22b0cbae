"""Penalties (presence, frequency, repetition, logit_bias) under speculation: a
verify row is penalized as of the tokens before it, so greedy output is
token-identical to target-only and sampling keeps the penalized target's
distribution (chi-square, with a power check: the unpenalized distribution is
rejected)."""
from __future__ import annotations

import numpy as np
import pytest

from hetero_sd.drafting import ModelDrafter, NgramDrafter
from hetero_sd.engine import Engine
from hetero_sd.errors import GenerationError
from hetero_sd.sampling import SamplingParams, penalize
from helpers.lossless import assert_lossless, load_runner
from helpers.table_model import TableRunner, chi_square_p, exact_joint
from helpers.tiny_models import random_prompt

PENALTIES = [dict(frequency_penalty=1.0), dict(presence_penalty=1.5), dict(repetition_penalty=1.4),
             dict(logit_bias=((7, 4.0), (9, -2.0))),
             dict(frequency_penalty=0.5, presence_penalty=0.5, repetition_penalty=1.2, logit_bias=((3, 1.0),))]


def test_a_verify_row_is_penalized_as_its_one_token_step():
    rng = np.random.default_rng(0)
    params = SamplingParams(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.3,
                            logit_bias=((2, 1.5),))
    prompt, output, drafts = [1, 2, 3], [4, 4, 5], [4, 6, 2]
    rows = rng.standard_normal((4, 10)).astype(np.float32)
    together = penalize(rows, params, prompt, output, drafts)
    for i in range(4):
        alone = penalize(rows[i:i + 1], params, prompt, output + drafts[:i], [])
        assert np.array_equal(together[i:i + 1], alone)
    assert not np.array_equal(together, rows)


@pytest.mark.parametrize("penalty", PENALTIES, ids=lambda d: "+".join(d))
def test_greedy_with_penalties_equals_target_only(tiny_model_dir, penalty):
    """The draft is the target's own weights, unpenalized: the penalties make the target
    reject some of its drafts, so accepting and rejecting rows both run."""
    target = load_runner("torch", tiny_model_dir("llama"))
    draft = load_runner("torch", tiny_model_dir("llama"))
    drafted = accepted = changed = 0
    for k in (1, 3, 5, 8):
        for seed in range(2):
            prompt = random_prompt(6 + 2 * k, seed=seed + 10 * k)
            engine = Engine(target, ModelDrafter(draft, target.vocab_size), k=k)
            stats = assert_lossless(_Penalized(engine, penalty), prompt, 20, f"{penalty} k={k}")
            drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
            changed += engine.generate_ids(prompt, 20, target_only=True).token_ids != \
                engine.generate_ids(prompt, 20, target_only=True, **penalty).token_ids
    assert 0 < accepted < drafted and changed > 0  # the penalties changed some outputs


class _Penalized:
    """An engine whose generate_ids always applies `penalty` (what assert_lossless calls)."""

    def __init__(self, engine, penalty):
        self.engine, self.penalty = engine, penalty

    def generate_ids(self, prompt, max_new, target_only=False):
        return self.engine.generate_ids(prompt, max_new, target_only=target_only, **self.penalty)


VOCAB, NEW, PROMPT = 4, 4, [0, 1, 2, 0, 1]


@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_penalized_sampling_keeps_the_penalized_distribution(drafter):
    params = SamplingParams(1.0, frequency_penalty=0.8, presence_penalty=0.3, repetition_penalty=1.3)
    target = TableRunner(VOCAB, seed=0)
    draft = NgramDrafter(1, 2) if drafter == "ngram" else \
        ModelDrafter(TableRunner(VOCAB, seed=0, noise=0.8, noise_seed=7), VOCAB)
    engine = Engine(target, draft, k=3)
    n, counts, drafted, accepted = 3000, {}, 0, 0
    for seed in range(n):
        res = engine.generate_ids(PROMPT, NEW, sampling=SamplingParams(
            1.0, seed=seed, frequency_penalty=0.8, presence_penalty=0.3, repetition_penalty=1.3))
        counts[tuple(res.token_ids)] = counts.get(tuple(res.token_ids), 0) + 1
        drafted, accepted = drafted + res.stats.drafted, accepted + res.stats.accepted
    assert chi_square_p(counts, exact_joint(target, params, PROMPT, NEW), n) > 1e-3
    # power: the same samples against the unpenalized distribution are rejected
    assert chi_square_p(counts, exact_joint(target, SamplingParams(1.0), PROMPT, NEW), n) < 1e-3
    assert 0 < accepted < drafted


@pytest.mark.parametrize("kwargs,field", [({"frequency_penalty": 3.0}, "frequency_penalty"),
                                          ({"presence_penalty": -2.5}, "presence_penalty"),
                                          ({"repetition_penalty": 0.0}, "repetition_penalty"),
                                          ({"logit_bias": ((1, 101.0),)}, "logit_bias")])
def test_bad_penalties_name_the_field(kwargs, field):
    with pytest.raises(GenerationError, match=field):
        SamplingParams(**kwargs)
