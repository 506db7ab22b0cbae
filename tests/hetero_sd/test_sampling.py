"""Speculative sampling is distribution-preserving and reproducible.

The main evidence: on a 4-token vocabulary (tests/helpers/table_model.py) the
target's exact distribution over whole 4-token continuations is enumerable, so
the frequencies of what the engine emits (target-only, n-gram drafts, a draft
model that differs from the target) are compared with it by a chi-square test
at significance ALPHA, at several temperature / top-k / top-p settings. Draws
use seeds 0..N-1, so every test is deterministic. A deliberately wrong
acceptance rule fails the same test, which shows the test has power.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from hetero_sd.backends.torch_backend import TorchBackend
from hetero_sd.drafting import ModelDrafter, NgramDrafter, SuffixDrafter
from hetero_sd.engine import Engine
from hetero_sd.errors import GenerationError
from hetero_sd.ir import load_model_ir
from hetero_sd.sampling import Sampler, SamplingParams, warp
from helpers.near import load_near
from helpers.table_model import TableRunner, chi_square_p, exact_joint
from helpers.tiny_models import random_prompt

ALPHA = 1e-3  # per test; the seeds are fixed, so a pass or a fail is reproducible
VOCAB, NEW = 4, 4
PROMPT = [0, 1, 2, 0, 1]  # repetitive, so the n-gram drafter proposes often
SETTINGS = [SamplingParams(1.0), SamplingParams(0.7), SamplingParams(1.5, top_k=2),
            SamplingParams(1.0, top_p=0.8), SamplingParams(1.3, top_k=3, top_p=0.9)]


def _emitted(engine: Engine, params: SamplingParams, n: int, target_only=False):
    counts: dict[tuple, int] = {}
    drafted = accepted = 0
    for seed in range(n):
        res = engine.generate_ids(PROMPT, NEW, target_only=target_only,
                                  sampling=SamplingParams(params.temperature, params.top_k, params.top_p, seed))
        key = tuple(res.token_ids)
        counts[key] = counts.get(key, 0) + 1
        drafted, accepted = drafted + res.stats.drafted, accepted + res.stats.accepted
    return counts, drafted, accepted


CORPUS = [[0, 1, 2, 3, 0, 1, 2, 3], [1, 1, 0, 2, 2, 3], [2, 0, 1, 3, 3, 1, 0]]


def _pinning(drafter):
    """A suffix drafter that seeded requests are pinned with (RequestMode.pinned), as inside
    a hybrid: declared not one-hot, so they draft from its own tree and the corpus alone."""
    drafter.one_hot = False
    return drafter


def _drafters():
    return {"ngram": NgramDrafter(1, 2),
            # earlier requests' outputs draft too, though every request here is seeded
            "suffix": SuffixDrafter(),
            # a pinned corpus alone (drafter.suffix_corpus), no earlier requests
            "suffix-corpus": SuffixDrafter(max_cached_requests=0, corpus=CORPUS),
            # the same corpus where seeded requests draft from it alone (earlier outputs kept apart)
            "suffix-corpus-seeded": _pinning(SuffixDrafter(corpus=CORPUS)),
            "model": ModelDrafter(TableRunner(VOCAB, seed=0, noise=0.8, noise_seed=7), VOCAB)}


@pytest.mark.parametrize("params", SETTINGS, ids=SamplingParams.describe)
@pytest.mark.parametrize("drafter", ["none", "ngram", "suffix", "suffix-corpus", "suffix-corpus-seeded", "model"])
def test_emitted_distribution_matches_target(params, drafter):
    target = TableRunner(VOCAB, seed=0)
    engine = Engine(target, None if drafter == "none" else _drafters()[drafter], k=3)
    n = 3000
    counts, drafted, accepted = _emitted(engine, params, n)
    p_value = chi_square_p(counts, exact_joint(target, params, PROMPT, NEW), n)
    assert p_value > ALPHA, f"{drafter} {params.describe()}: chi-square p={p_value:.2e}"
    if drafter != "none":  # both outcomes of the acceptance test must have happened
        assert 0 < accepted < drafted


def test_wrong_acceptance_rule_is_detected(monkeypatch):
    """Power check: accepting every draft (no rejection step) must fail the same test."""
    def accept_all(self, drafts, p, q, position):
        return len(drafts), list(drafts) + [int(np.argmax(self.accept_rng.multinomial(1, p[len(drafts)])))]

    monkeypatch.setattr(Sampler, "accept", accept_all)
    target = TableRunner(VOCAB, seed=0)
    engine = Engine(target, _drafters()["model"], k=3)
    params = SamplingParams(1.0)
    counts, _, _ = _emitted(engine, params, 3000)
    assert chi_square_p(counts, exact_joint(target, params, PROMPT, NEW), 3000) < ALPHA


@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_seeded_runs_reproduce(drafter):
    target = TableRunner(VOCAB, seed=0)
    engine = Engine(target, _drafters()[drafter], k=3)
    params = SamplingParams(1.0, top_p=0.9, seed=1234)
    runs = [engine.generate_ids(PROMPT, 40, sampling=params).token_ids for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    others = {tuple(engine.generate_ids(PROMPT, 40, sampling=SamplingParams(1.0, seed=s)).token_ids)
              for s in range(5)}
    assert len(others) > 1, "different seeds should give different text"


def test_warp_matches_transformers():
    """Temperature, then top-k, then top-p, with transformers' own warpers as the oracle."""
    rng = np.random.default_rng(0)
    for temperature, top_k, top_p in [(1.0, 0, 1.0), (0.6, 5, 1.0), (1.4, 0, 0.7), (0.9, 10, 0.85),
                                      (2.0, 1, 1.0), (1.0, 0, 0.05)]:
        logits = rng.standard_normal((3, 50)).astype(np.float32) * 3
        ours = warp(logits, SamplingParams(temperature, top_k, top_p))
        procs = LogitsProcessorList([TemperatureLogitsWarper(temperature)]
                                    + ([TopKLogitsWarper(top_k)] if top_k else [])
                                    + ([TopPLogitsWarper(top_p)] if top_p < 1 else []))
        ref = torch.softmax(procs(None, torch.from_numpy(logits)), dim=-1).double().numpy()
        np.testing.assert_array_equal(ours > 0, ref > 0)
        np.testing.assert_allclose(ours, ref, atol=1e-6)


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.5}, "temperature must be >= 0"),
    ({"temperature": float("nan")}, "temperature must be a number"),
    ({"temperature": float("inf")}, "temperature must be finite"),
    ({"top_p": 0.0}, "top_p must be in (0, 1]"),
    ({"top_p": 1.5}, "top_p must be in (0, 1]"),
    ({"top_k": -1}, "top_k must be an integer >= 0"),
    ({"top_k": 2.5}, "top_k must be an integer >= 0"),
    ({"seed": -3}, "seed must be a non-negative integer"),
])
def test_bad_sampling_parameters(kwargs, message):
    with pytest.raises(GenerationError, match=message.replace("(", r"\(").replace("]", r"\]")):
        SamplingParams(**kwargs)
    engine = Engine(TableRunner(VOCAB, seed=0), None)
    with pytest.raises(GenerationError, match=message.replace("(", r"\(").replace("]", r"\]")):
        engine.generate_ids(PROMPT, 4, **kwargs)


@pytest.mark.parametrize("temperature", [1e-310, 5e-324, 1e-6])
def test_a_temperature_too_small_to_divide_by_decodes_greedily(temperature):
    """Under GREEDY_BELOW (1e-5) a temperature is greedy, as 0 is: logits over a subnormal one
    overflow to inf and their probabilities to NaN, so nothing may divide by it."""
    params = SamplingParams(temperature)
    assert params.greedy and params.describe() == "greedy"
    logits = np.random.default_rng(0).standard_normal((3, 50)).astype(np.float32) * 3
    probs = warp(logits, params)
    assert np.isfinite(probs).all()
    np.testing.assert_array_equal(probs, np.eye(50)[logits.argmax(-1)])
    with pytest.raises(ValueError, match="a Sampler is for temperature > 0"):
        Sampler(params)
    target = TableRunner(VOCAB, seed=0)
    for drafter in (None, NgramDrafter(1, 2)):
        engine = Engine(target, drafter, k=3)
        want = engine.generate_ids(PROMPT, 24).token_ids
        assert engine.generate_ids(PROMPT, 24, sampling=SamplingParams(temperature, seed=5)).token_ids == want
        assert engine.generate_ids(PROMPT, 24, temperature=temperature).token_ids == want
    assert not SamplingParams(1e-5).greedy  # the floor itself samples (finitely: logits / 1e-5)
    assert np.isfinite(warp(logits, SamplingParams(1e-5))).all()


def test_unknown_sampling_option_is_an_error():
    with pytest.raises(GenerationError, match="unknown sampling option.*temprature"):
        Engine(TableRunner(VOCAB, seed=0), None).generate_ids(PROMPT, 4, temprature=0.5)


class _Biased:
    """A draft runner: the same model with a fixed logit bias, so q differs from p
    but overlaps it (a different random model would share no top-k support)."""

    def __init__(self, runner, seed=0, scale=1.0):
        self.runner = runner
        self.bias = scale * np.random.default_rng(seed).standard_normal(runner.vocab_size).astype(np.float32)

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def forward(self, seq_id, tokens, start, num_logits):
        return self.runner.forward(seq_id, tokens, start, num_logits) + self.bias

    def greedy(self, seq_id, tokens, start, num_logits):
        return [int(i) for i in self.forward(seq_id, tokens, start, num_logits).argmax(-1)]


def test_real_model_sampling(tiny_model_dir):
    """On a real (tiny) Llama: seeded reproducibility with both drafters, and the
    first two sampled tokens follow the target's distribution (chi-square)."""
    backend = TorchBackend()
    target = backend.load(load_model_ir(tiny_model_dir("llama")), "cpu", "fp32", 4 << 20)
    draft = _Biased(load_near(tiny_model_dir("llama")))
    prompt = random_prompt(12, seed=3)
    params = SamplingParams(1.0, top_k=3)
    for drafter in (NgramDrafter(1, 3), ModelDrafter(draft, target.vocab_size)):
        engine = Engine(target, drafter, k=4)
        seeded = SamplingParams(0.8, top_p=0.9, seed=7)
        assert engine.generate_ids(prompt, 30, sampling=seeded).token_ids == \
            engine.generate_ids(prompt, 30, sampling=seeded).token_ids
    # Exact joint of (t1, t2, t3) under top-k 3 from the target's own logits.
    seq = target.allocate(16)
    expected = {}
    for t1, p1 in enumerate(warp(target.forward(seq, prompt, 0, 1), params)[0]):
        if p1 == 0:
            continue
        for t2, p2 in enumerate(warp(target.forward(seq, [t1], len(prompt), 1), params)[0]):
            if p2 == 0:
                continue
            row = warp(target.forward(seq, [t2], len(prompt) + 1, 1), params)[0]
            for t3 in np.flatnonzero(row):
                expected[(t1, t2, int(t3))] = p1 * p2 * row[t3]
    target.release(seq)
    engine = Engine(target, ModelDrafter(draft, target.vocab_size), k=2)
    n, counts, drafted, accepted = 500, {}, 0, 0
    for seed in range(n):
        res = engine.generate_ids(prompt, 3, sampling=SamplingParams(1.0, top_k=3, seed=seed))
        counts[tuple(res.token_ids)] = counts.get(tuple(res.token_ids), 0) + 1
        drafted, accepted = drafted + res.stats.drafted, accepted + res.stats.accepted
    assert 0 < accepted < drafted
    assert chi_square_p(counts, expected, n) > ALPHA


class _NaNRunner(TableRunner):
    def forward(self, seq_id, tokens, start, num_logits):
        return np.full_like(super().forward(seq_id, tokens, start, num_logits), np.nan)


def test_a_draft_model_with_nan_logits_is_dropped_not_trusted():
    """A non-finite q would bias the rejection step: the drafter fails instead, the
    target carries on alone, and the seeded output is the target-only one."""
    target = TableRunner(VOCAB, seed=0)
    engine = Engine(target, ModelDrafter(_NaNRunner(VOCAB, seed=0), VOCAB), k=3)
    for seed in range(5):
        params = SamplingParams(1.0, seed=seed)
        spec = engine.generate_ids(PROMPT, 12, sampling=params)
        assert any("not finite" in e for e in spec.stats.events)
        assert spec.token_ids == engine.generate_ids(PROMPT, 12, sampling=params, target_only=True).token_ids
        engine = Engine(target, ModelDrafter(_NaNRunner(VOCAB, seed=0), VOCAB), k=3)  # the failed one is gone

