"""Sampling under a grammar is distribution-preserving.

On the 4-token table model (three letters and EOS) with the regex (a|bc)+, the
exact distribution of constrained target-only sampling over whole outputs is
enumerated with an independent oracle (the `regex` module's partial matching
decides what is allowed, not llguidance), and the engine's emitted outputs are
compared with it by a chi-square test: target-only, n-gram drafts, a draft
model that drafts inside the grammar (masked q), and one that ignores it (its
q unmasked, like a worker drafter). Two deliberately wrong implementations
fail the same test, which shows it has power:
- a drafter that samples inside the grammar but reports its unmasked q;
- cutting a sampled draft the grammar refuses instead of letting the
  rejection step reject it (draws from p where the residual is due).
"""
from __future__ import annotations

import numpy as np
import pytest
import regex

from hetero_sd.constraint import Constraint
from hetero_sd.constraint.guide import mask_logits
from hetero_sd.constraint.rounds import Constrainer
from hetero_sd.drafting import ModelDrafter, NgramDrafter
from hetero_sd.engine import Engine
from hetero_sd.sampling import SamplingParams
from helpers.drafters import ProxyDrafter
from helpers.table_model import TableRunner, TableTokenizer, chi_square_p, exact_constrained_joint

ALPHA = 1e-3
VOCAB, NEW, N = 4, 4, 3000
PROMPT = [0, 1, 2, 0, 1]
PATTERN = "(a|bc)+"  # 'c' only after 'b', 'b' always followed by 'c'; EOS when not after 'b'
SETTINGS = [SamplingParams(1.0), SamplingParams(1.4, top_k=2), SamplingParams(1.2, top_p=0.85)]


class Unguided(ProxyDrafter):
    """A drafter that never sees the grammar (as a worker drafter does not)."""

    def begin(self, capacity, sampler=None, guide=None):
        self.inner.begin(capacity, sampler)


def _draft_model():
    return ModelDrafter(TableRunner(VOCAB, seed=0, noise=1.0, noise_seed=7), VOCAB)


def _drafter(name: str):
    return {"none": lambda: None, "ngram": lambda: NgramDrafter(1, 2), "model": _draft_model,
            "model unguided": lambda: Unguided(_draft_model())}[name]()


def _emitted(engine: Engine, params: SamplingParams, n: int = N):
    tok, counts, stats = engine.tokenizer, {}, {"drafted": 0, "accepted": 0, "cut": 0}
    for seed in range(n):
        res = engine.generate_ids(PROMPT, NEW, constraint=Constraint.regex(PATTERN),
                                  sampling=SamplingParams(params.temperature, params.top_k, params.top_p, seed))
        text = tok.decode(res.token_ids)
        assert regex.fullmatch(PATTERN, text, partial=True), f"output {text!r} left the grammar"
        if res.stats.finish_reason == "eos":
            assert regex.fullmatch(PATTERN, text), f"EOS after {text!r}, which the grammar does not accept"
        counts[tuple(res.token_ids)] = counts.get(tuple(res.token_ids), 0) + 1
        stats["drafted"] += res.stats.drafted
        stats["accepted"] += res.stats.accepted
        stats["cut"] += res.stats.grammar_cut
    return counts, stats


def _engine(drafter: str) -> tuple[Engine, TableRunner]:
    target, tok = TableRunner(VOCAB, seed=0), TableTokenizer()
    return Engine(target, _drafter(drafter), k=3, tokenizer=tok, eos_ids=(tok.eos_token_id,)), target


def _p_value(engine, target, params, counts) -> float:
    expected = exact_constrained_joint(target, params, PROMPT, NEW, PATTERN, engine.tokenizer)
    return chi_square_p(counts, expected, N)


@pytest.mark.parametrize("drafter, params", [("none", SETTINGS[0])] + [
    (d, p) for d in ("ngram", "model", "model unguided") for p in SETTINGS],
    ids=lambda x: x.describe() if isinstance(x, SamplingParams) else x)
def test_constrained_sampling_matches_target(drafter, params):
    engine, target = _engine(drafter)
    counts, stats = _emitted(engine, params)
    p_value = _p_value(engine, target, params, counts)
    assert p_value > ALPHA, f"{drafter} {params.describe()}: chi-square p={p_value:.2e}"
    if drafter != "none":  # both outcomes of the acceptance test happened
        assert 0 < stats["accepted"] < stats["drafted"], stats
    if drafter == "model":  # it drafts inside the grammar: nothing to cut
        assert stats["cut"] == 0
    if drafter in ("ngram", "model unguided"):  # the grammar refused some drafts
        assert stats["cut"] > 0, stats


def test_unmasked_q_is_detected(monkeypatch):
    """Power check: drafts drawn inside the grammar, but q reported unmasked."""
    def next_with_unmasked_q(self, feed, stop, i):  # (ModelDrafter._next's contract: token, q, go on)
        raw = self.runner.forward(self._seq, feed, len(self._cached), 1)[-1:]
        token, _ = self._sampler.sample_draft(mask_logits(raw, self._guide.allowed()))
        return token, self._sampler.probs(raw)[-1], True

    monkeypatch.setattr(ModelDrafter, "_next", next_with_unmasked_q)
    engine, target = _engine("model")
    params = SamplingParams(1.0)
    counts, stats = _emitted(engine, params)
    assert stats["drafted"] > 0, "the patched drafter never drafted (its signature no longer _next's?)"
    assert _p_value(engine, target, params, counts) < ALPHA


def test_cutting_a_sampled_refused_draft_is_detected(monkeypatch):
    """Power check: the sampled draft the grammar refuses is cut away instead of rejected."""
    def cut_at_first_refused(self, drafts, probs, k):
        keep = self.guide.valid_prefix(drafts)
        return drafts[:keep], None if probs is None else probs[:keep]

    monkeypatch.setattr(Constrainer, "cut", cut_at_first_refused)
    engine, target = _engine("model unguided")
    params = SamplingParams(1.0)
    counts, _ = _emitted(engine, params)
    assert _p_value(engine, target, params, counts) < ALPHA


def test_seeded_constrained_runs_reproduce():
    engine, _ = _engine("model")
    params = SamplingParams(1.0, seed=99)
    runs = {tuple(engine.generate_ids(PROMPT, 30, sampling=params, constraint=Constraint.regex(PATTERN)).token_ids)
            for _ in range(3)}
    assert len(runs) == 1
