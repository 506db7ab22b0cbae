"""Speculative sampling with an EAGLE-3 head as the drafter is distribution-preserving.

As in test_sampling.py: on the 4-token table model (tests/helpers/table_model.py)
the target's exact distribution over whole 4-token continuations is enumerable,
and the frequencies of what the engine emits over seeds 0..N-1 are compared with
it by a chi-square test at significance ALPHA. Here the target also returns
"hidden states" (TableRunner(features=W)), and the drafter is HeadDrafter over a
small random EAGLE-3 head whose draft vocabulary leaves one target token out
(draft ids 0, 1, 2 -> target ids 0, 2, 3), so the head's q must be scattered into
the target vocabulary, zero at token 1, to stay lossless. Mutated drafters that
report a wrong q (wrongly scattered, or taken before the warp) fail the same
test, which shows it has power.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hetero_sd.backends.torch_head import TorchHeadRunner
from hetero_sd.drafting.head import HeadDrafter
from hetero_sd.engine import Engine
from hetero_sd.errors import GenerationError
from hetero_sd.ir.config import ModelConfig
from hetero_sd.ir.eagle import EagleHead, HeadConfig
from hetero_sd.sampling import SamplingParams, warp
from helpers.table_model import TableRunner, chi_square_p, exact_joint

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny torch ops: threads only contend

ALPHA = 1e-3  # per test; the seeds are fixed, so a pass or a fail is reproducible
VOCAB, NEW, WIDTH = 4, 4, 8  # WIDTH: the table target's feature row (its "hidden size")
PROMPT = [0, 1, 2, 0, 1]
DRAFT_IDS = [0, 2, 3]  # draft id -> target id: target token 1 is outside the draft vocabulary
N = 3000
N_POWER = 1000  # the mutants fail by far at 1000 draws already (fewer draws: a harder test for them)
# test_sampling.SETTINGS but its plain T=1 (for time): temperature, top-k, top-p, all three.
SETTINGS = [SamplingParams(0.7), SamplingParams(1.5, top_k=2), SamplingParams(1.0, top_p=0.8),
            SamplingParams(1.3, top_k=3, top_p=0.9)]
# Weights N(0, SCALE^2 / fan_in): head logits spread over a few units, so q is neither
# flat nor one-hot (about 35-50% of drafts accepted) and differs from the target's p.
SCALE = 3.0


def _head() -> EagleHead:
    model = ModelConfig(family="llama", vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_layers=1,
                        num_heads=2, num_kv_heads=1, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
                        max_position_embeddings=1024, tie_word_embeddings=False)
    cfg = HeadConfig(model, draft_vocab=len(DRAFT_IDS), target_hidden=WIDTH, aux_layers=(1,))
    assert cfg.feature_layers == (0,)  # the table target's one feature layer
    gen = torch.Generator().manual_seed(0)
    head = EagleHead(cfg, torch.randn(VOCAB, 16, generator=gen))
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 1:  # norm weights
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(SCALE * torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
    head.set_vocab(torch.tensor(DRAFT_IDS))
    return head.eval()


HEAD = _head()


def _drafter(cls=HeadDrafter) -> HeadDrafter:
    return cls(TorchHeadRunner(HEAD), VOCAB)


def _target() -> TableRunner:
    return TableRunner(VOCAB, seed=0, features=WIDTH)


def _emitted(engine: Engine, params: SamplingParams, n: int):
    counts: dict[tuple, int] = {}
    drafted = accepted = 0
    for seed in range(n):
        res = engine.generate_ids(PROMPT, NEW,
                                  sampling=SamplingParams(params.temperature, params.top_k, params.top_p, seed))
        key = tuple(res.token_ids)
        counts[key] = counts.get(key, 0) + 1
        drafted, accepted = drafted + res.stats.drafted, accepted + res.stats.accepted
    return counts, drafted, accepted


def _p_value(drafter: HeadDrafter, params: SamplingParams, n: int):
    target = _target()
    counts, drafted, accepted = _emitted(Engine(target, drafter, k=3), params, n)
    return chi_square_p(counts, exact_joint(target, params, PROMPT, NEW), n), drafted, accepted


def test_the_table_target_returns_features():
    """TableRunner(features=W): one feature row per input row of the latest call, a
    function of the context up to that row, taken once; none without features."""
    target = _target()
    seq = target.allocate(16)
    target.forward(seq, [0, 1, 2], 0, 1)
    rows = target.take_features(seq)
    assert rows.dtype == np.float32 and rows.shape == (3, WIDTH)
    assert target.take_features(seq) is None
    target.greedy(seq, [3, 1], 2, 2)  # overwrites position 2: rows for [0, 1, 3], [0, 1, 3, 1]
    np.testing.assert_array_equal(target.take_features(seq),
                                  np.stack([target.features_for([0, 1, 3]), target.features_for([0, 1, 3, 1])]))
    np.testing.assert_array_equal(rows[1], target.features_for([0, 1]))
    assert target.feature_layers == (0,) and TableRunner(VOCAB, seed=0).feature_layers == ()


@pytest.mark.parametrize("params", SETTINGS, ids=SamplingParams.describe)
def test_emitted_distribution_matches_target(params):
    p_value, drafted, accepted = _p_value(_drafter(), params, N)
    assert p_value > ALPHA, f"head {params.describe()}: chi-square p={p_value:.2e}"
    assert 0 < accepted < drafted  # the head drafted (features reached it), and both outcomes happened


class _Unmasked(HeadDrafter):
    """A scatter mistake: q from the draft logits scattered into zeros, not -inf, so it
    leaks mass to target token 1, which the head never proposes (the token is still
    drawn from the right distribution: only the reported q is wrong)."""

    def _choose(self, logits):
        token, q = super()._choose(logits)
        if q is not None:
            full = np.zeros((1, self.target_vocab), dtype=np.float32)
            full[0, self._ids] = logits
            q = self._sampler.probs(full)[-1]
        return token, q


class _Unwarped(HeadDrafter):
    """q taken before the warp (softmax of the scattered logits at T=1, no top-k or
    top-p), while the token is drawn from the warped distribution."""

    def _choose(self, logits):
        token, q = super()._choose(logits)
        if q is not None:
            full = np.full((1, self.target_vocab), -np.inf, dtype=np.float32)
            full[0, self._ids] = logits
            q = warp(full, SamplingParams(1.0))[-1]
        return token, q


# Power checks: each mutant must fail the chi-square at a setting the correct head
# passes above. At T=1 alone the unwarped q would equal the warped one, so _Unwarped
# is checked under top-p, where they differ; the unmasked scatter under temperature
# alone (under top-k / top-p its q can drop a token the head drafts, and the sampler's
# guard refuses that before any chi-square).
@pytest.mark.parametrize("cls, params", [(_Unmasked, SamplingParams(0.7)), (_Unwarped, SamplingParams(1.0, top_p=0.8))],
                         ids=["unmasked-scatter", "q-before-warp"])
def test_a_wrong_draft_distribution_is_detected(cls, params):
    p_value, drafted, accepted = _p_value(_drafter(cls), params, N_POWER)
    assert 0 < accepted < drafted
    assert p_value < ALPHA, f"{cls.__name__} {params.describe()} passed: chi-square p={p_value:.2e}"


class _AtDraftIds(HeadDrafter):
    """q with the draft-vocabulary probabilities at the draft ids (0..2), not the target
    ids (0, 2, 3), the token still right."""

    def _choose(self, logits):
        token, q = super()._choose(logits)
        if q is not None:
            wrong = np.zeros_like(q)
            wrong[:len(self._ids)] = q[self._ids]
            q = wrong
        return token, q


def test_q_at_the_draft_ids_is_refused():
    """The chi-square never sees this mistake: the first drafted target token 3 (draft id
    2) has q = 0 at its own id, and the sampler refuses the round outright."""
    engine = Engine(_target(), _drafter(_AtDraftIds), k=3)
    with pytest.raises(GenerationError, match="draft token 3 has probability 0 under its own draft distribution"):
        for seed in range(200):
            engine.generate_ids(PROMPT, NEW, sampling=SamplingParams(1.0, seed=seed))


def test_seeded_runs_reproduce():
    params = SamplingParams(1.0, top_p=0.9, seed=1234)
    engine = Engine(_target(), _drafter(), k=3)
    runs = [engine.generate_ids(PROMPT, 40, sampling=params) for _ in range(2)]
    fresh = Engine(_target(), _drafter(), k=3).generate_ids(PROMPT, 40, sampling=params)
    assert runs[0].token_ids == runs[1].token_ids == fresh.token_ids
    assert runs[0].stats.drafted > 0
    others = {tuple(engine.generate_ids(PROMPT, 40, sampling=SamplingParams(1.0, seed=s)).token_ids)
              for s in range(5)}
    assert len(others) > 1, "different seeds should give different text"
