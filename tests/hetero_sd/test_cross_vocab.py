"""A draft model of another tokenizer (drafting/cross_vocab.py).

Sampling: Token-Level Intersection must keep the target's distribution. On
table models with two different vocabularies (the target spells a, b, c; the
draft b, a, d in another order, so shared ids differ and each side has a token
the other lacks) the target's exact distribution over 4-token continuations is
enumerable, and what the engine emits is compared with it by chi-square. Three
deliberately wrong proposals show the test has power: q not restricted to the
intersection and q not renormalised fail it, and a token outside the
intersection is refused by the rejection step.

Greedy: tiny transformers models with two different trained BPE tokenizers,
through the real config path, on every backend: output token-identical to the
target alone for k = 1..8.
"""
from __future__ import annotations

import numpy as np
import pytest

from hetero_sd.drafting.cross_vocab import CrossVocabDrafter, VocabBridge, token_pieces
from hetero_sd.engine import Engine
from hetero_sd.errors import GenerationError
from hetero_sd.sampling import SamplingParams, draw
from helpers.table_model import LetterCodec, TableRunner, chi_square_p, exact_joint, letter_bridge as _bridge

ALPHA = 1e-3
PROMPT, NEW, N = [0, 1, 2, 0, 1], 4, 3000


def _engine(drafter_cls=CrossVocabDrafter) -> tuple[Engine, TableRunner]:
    target = TableRunner(4, seed=0)
    draft = TableRunner(4, seed=3, scale=1.0)
    return Engine(target, drafter_cls(draft, _bridge()), k=3), target


def _emitted(engine: Engine, params: SamplingParams, n: int = N):
    counts, drafted, accepted = {}, 0, 0
    for seed in range(n):
        res = engine.generate_ids(PROMPT, NEW, sampling=SamplingParams(params.temperature, params.top_k,
                                                                      params.top_p, seed))
        counts[tuple(res.token_ids)] = counts.get(tuple(res.token_ids), 0) + 1
        drafted, accepted = drafted + res.stats.drafted, accepted + res.stats.accepted
    return counts, drafted, accepted


def test_the_bridge_maps_equal_bytes_only():
    bridge = _bridge()
    assert bridge.to_target.tolist() == [1, 0, -1, 3]  # b->1, a->0, d: none, </s>->3
    q = np.array([0.5, 0.3, 0.0, 0.2])
    assert bridge.scatter(q).tolist() == [0.3, 0.5, 0.0, 0.2]
    assert bridge.draft_context([0, 2, 1]) == [1, 2, 0]  # "acb": c spelled as the draft's unknown
    assert bridge.target_continuation([0, 1], [0, 1]) == [1, 0]  # the draft's "ba"


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_k=3),
                                    SamplingParams(1.2, top_p=0.85)], ids=SamplingParams.describe)
def test_token_level_intersection_keeps_the_target_distribution(params):
    engine, target = _engine()
    counts, drafted, accepted = _emitted(engine, params)
    p_value = chi_square_p(counts, exact_joint(target, params, PROMPT, NEW), N)
    assert p_value > ALPHA, f"{params.describe()}: chi-square p={p_value:.2e}"
    assert 0 < accepted < drafted  # both outcomes of the acceptance test happened


def test_a_restricted_head_keeps_the_target_distribution():
    """A draft head scoring only its first 3 ids (vocab: 3; it never proposes </s>): the
    bridge covers those, and Token-Level Intersection still keeps the target's distribution."""
    from hetero_sd.drafting.cross_vocab import VocabBridge
    from helpers.table_model import LetterCodec

    target = TableRunner(4, seed=0)
    bridge = VocabBridge(LetterCodec("abc", unknown=2), LetterCodec("bad", unknown=2), 4, 3)
    assert bridge.to_target.tolist() == [1, 0, -1]
    engine = Engine(target, CrossVocabDrafter(TableRunner(3, seed=3, scale=1.0), bridge), k=3)
    params = SamplingParams(1.0)
    counts, drafted, accepted = _emitted(engine, params)
    p_value = chi_square_p(counts, exact_joint(target, params, PROMPT, NEW), N)
    assert p_value > ALPHA, f"chi-square p={p_value:.2e}"
    assert 0 < accepted < drafted


class _Unrestricted(CrossVocabDrafter):
    """Wrong: draws from the whole q (a token the target lacks ends the draft) and
    reports that q, not the one its proposals actually come from."""

    def _propose(self, q):
        token = draw(q, self._sampler.draft_rng)
        if not self.bridge.shared[token]:
            return None
        return token, int(self.bridge.to_target[token]), self.bridge.scatter(q)


class _Unnormalised(CrossVocabDrafter):
    """Wrong: restricts q but reports it without renormalising."""

    def _propose(self, q):
        restricted = np.where(self.bridge.shared, q, 0.0)
        if restricted.sum() <= 0:
            return None
        token = draw(restricted / restricted.sum(), self._sampler.draft_rng)
        return token, int(self.bridge.to_target[token]), self.bridge.scatter(restricted)


class _Outside(CrossVocabDrafter):
    """Wrong: a draft token the target lacks is proposed anyway, under the target id
    of the same number, with q as if only shared tokens could be drawn."""

    def _propose(self, q):
        token = draw(q, self._sampler.draft_rng)
        shared = self.bridge.shared
        target_token = int(self.bridge.to_target[token]) if shared[token] else token
        return token, target_token, self.bridge.scatter(np.where(shared, q, 0.0) / q[shared].sum())


@pytest.mark.parametrize("wrong", [_Unrestricted, _Unnormalised])
def test_each_wrong_q_is_detected(wrong):
    engine, target = _engine(wrong)
    params = SamplingParams(1.0)
    counts, _, _ = _emitted(engine, params)
    assert chi_square_p(counts, exact_joint(target, params, PROMPT, NEW), N) < ALPHA


def test_a_token_outside_the_intersection_is_refused():
    """Its q says the proposal could not have been drawn: the rejection step refuses it
    (a ratio p/q over a zero q would accept it whatever the target says)."""
    engine, _ = _engine(_Outside)
    with pytest.raises(GenerationError, match="probability 0 under its own draft distribution"):
        _emitted(engine, SamplingParams(1.0), 200)


def test_greedy_output_is_the_target_s():
    target = TableRunner(4, seed=0)
    alone = Engine(target, None).generate_ids(PROMPT, 24).token_ids
    for k in range(1, 9):
        engine = Engine(target, CrossVocabDrafter(TableRunner(4, seed=3, scale=1.0), _bridge()), k=k)
        res = engine.generate_ids(PROMPT, 24)
        assert res.token_ids == alone, k
        assert res.stats.drafted > 0


@pytest.mark.parametrize("cross", [False, True], ids=["same-vocab", "cross-vocab"])
def test_min_prob_stops_unsure_greedy_drafts_and_stays_lossless(cross):
    from hetero_sd.drafting import ModelDrafter

    target = TableRunner(4, seed=0)
    alone = Engine(target, None).generate_ids(PROMPT, 30).token_ids
    drafted = {}
    for min_prob in (0.0, 0.45, 0.99):
        draft = TableRunner(4, seed=3, scale=1.0)
        drafter = CrossVocabDrafter(draft, _bridge(), min_prob) if cross else ModelDrafter(draft, 4, min_prob=min_prob)
        res = Engine(target, drafter, k=4).generate_ids(PROMPT, 30)
        assert res.token_ids == alone, min_prob
        drafted[min_prob] = res.stats.drafted
    assert drafted[0.0] > drafted[0.45] > drafted[0.99] == 0, drafted


@pytest.mark.parametrize("cross", [False, True], ids=["same-vocab", "cross-vocab"])
def test_a_padded_target_s_free_row_takes_a_draft_below_min_prob(cross):
    """Where the target pads a one-token call (its second row is computed anyway), the
    first draft of a greedy round is proposed however unsure the draft model is; the
    drafts after it still stop below min_prob, and the output is the target's."""
    from hetero_sd.drafting import ModelDrafter

    target = TableRunner(4, seed=0)
    alone = Engine(target, None).generate_ids(PROMPT, 30).token_ids
    got = {}
    for padded in (False, True):
        target.pads_single_row = padded
        draft = TableRunner(4, seed=3, scale=1.0)
        drafter = CrossVocabDrafter(draft, _bridge(), 0.99) if cross else ModelDrafter(draft, 4, min_prob=0.99)
        res = Engine(target, drafter, k=4).generate_ids(PROMPT, 30)
        assert res.token_ids == alone, padded
        got[padded] = res.stats
    assert got[False].drafted == 0
    stats = got[True]
    assert stats.drafted > 0 and len(stats.drafted_pos) == 1  # one draft a round: min_prob stops the rest
    assert stats.drafted >= stats.rounds - 2  # every round but the last drafts (cross: one may spell nothing)


def test_pieces_of_a_byte_level_tokenizer():
    from helpers.tiny_models import make_tokenizer

    tok = make_tokenizer()
    pieces = token_pieces(tok)
    ids = tok.encode("The capital of France is Paris.", add_special_tokens=False)
    assert b"".join(pieces[i] for i in ids) == b"The capital of France is Paris."
    assert pieces[tok.convert_tokens_to_ids("<|im_start|>")] == b"<|im_start|>"


# ------------------------------------------------------------------ greedy, real models
DRAFT_VOCAB = 320  # the target's tokenizer has 384 entries: another BPE over the same corpus


@pytest.fixture(scope="module")
def foreign_draft(tmp_path_factory):
    from helpers.tiny_models import make_hf_model

    return make_hf_model(tmp_path_factory.mktemp("foreign") / "draft", "llama", seed=1, vocab_size=DRAFT_VOCAB)


def _from_yaml(tmp_path, target: str, drafter: str, extra: str = "", budget: str = "4MiB") -> Engine:
    """An engine built through the config path from `target:` and `drafter:` flow mappings."""
    from hetero_sd.config import load_config

    path = tmp_path / "cfg.yaml"
    path.write_text(f"{extra}target: {{{target}}}\ndrafter: {{{drafter}}}\nmemory: {{kv_budget: {budget}}}\n")
    return Engine.from_config(load_config(path))

def _assert_lossless_for_every_k(engine, prompt, n):
    """Each fixed draft length 1..8 drafts something and gives the target's own output."""
    from hetero_sd.scheduler import FixedDraftLength

    alone = engine.generate_ids(prompt, n, target_only=True).token_ids
    for k in range(1, 9):
        engine.policy = FixedDraftLength(k)
        res = engine.generate_ids(prompt, n)
        assert res.token_ids == alone, f"k={k}"
        assert res.stats.drafted > 0 and res.stats.lossless == "exact"


PAIRS = [("onnxruntime", "int4", "torch", "fp32"), ("torch", "fp32", "onnxruntime", "int4"),
         ("openvino", "fp32", "onnxruntime", "fp32")]


@pytest.mark.parametrize("target_backend,target_precision,draft_backend,draft_precision", PAIRS)
def test_a_draft_of_another_tokenizer_is_lossless(tiny_model_dir, foreign_draft, tmp_path, target_backend,
                                                  target_precision, draft_backend, draft_precision):
    from helpers.tiny_models import make_tokenizer

    engine = _from_yaml(tmp_path, f"model: {tiny_model_dir('llama')}, backend: {target_backend}, "
                                  f"precision: {target_precision}",
                        f"kind: model, model: {foreign_draft}, backend: {draft_backend}, "
                        f"precision: {draft_precision}, k: 3")
    prompt = make_tokenizer().encode("The capital of France is Paris. How many legs", add_special_tokens=False)
    _assert_lossless_for_every_k(engine, prompt, 40)


def test_a_hybrid_with_a_draft_of_another_tokenizer_is_lossless(tiny_model_dir, foreign_draft, tmp_path):
    """kind: hybrid, hybrid_with: model: suffix drafts where the text repeats, the
    foreign draft elsewhere: output equal to the target alone."""
    from hetero_sd.drafting.hybrid import HybridDrafter

    engine = _from_yaml(tmp_path, f"model: {tiny_model_dir('llama')}, backend: onnxruntime, precision: int4",
                        f"kind: hybrid, hybrid_with: model, model: {foreign_draft}, backend: onnxruntime, "
                        "precision: fp32, k: 4, min_prob: 0.2")
    assert isinstance(engine._drafter.default, HybridDrafter)
    assert isinstance(engine._drafter.default.head, CrossVocabDrafter)
    from helpers.tiny_models import make_tokenizer

    prompt = make_tokenizer().encode("red green blue, red green blue, red green blue. The capital of",
                                     add_special_tokens=False)
    alone = engine.generate_ids(prompt, 40, target_only=True).token_ids
    res = engine.generate_ids(prompt, 40)
    assert res.token_ids == alone and res.stats.drafted > 0
    assert sum(engine._drafter.default.picks.values()) > 0


def test_automatic_placement_plans_a_draft_of_another_tokenizer(tiny_model_dir, foreign_draft, tmp_path,
                                                               monkeypatch):
    """placement: auto profiles the foreign draft like any (declared costs, no clock),
    and the plan's draft drafts through the text, losslessly."""
    import json

    from hetero_sd import profiler
    from hetero_sd.testing.fake_backend import ENV, declared_figures

    monkeypatch.setattr(profiler, "measure_runner", declared_figures)
    monkeypatch.setenv(ENV, json.dumps({"simulate_time": False, "devices": [
        # a device name of its own: profiles are cached per device for the test session
        {"device": "fake:9", "costs": {"decode_per_token_s": 0.005, "verify_base_s": 0.005,
                                       "verify_per_token_s": 0.0002, "prefill_per_token_s": 1e-5}}]}))
    engine = _from_yaml(tmp_path, f"model: {tiny_model_dir('llama')}", f"kind: model, model: {foreign_draft}, k: auto",
                        "placement: auto\nauto: {quick: true, backends: [fake], precisions: [fp32], "
                        "acceptance: {model: 0.95}}\n", budget="1MiB")
    assert engine.plan is not None  # (k: auto keeps a speculative plan's drafter even where none leads)
    assert isinstance(engine._drafter.default, CrossVocabDrafter)
    prompt = list(range(5, 25))
    assert engine.generate_ids(prompt, 16).token_ids == engine.generate_ids(prompt, 16, target_only=True).token_ids


def test_what_a_draft_of_another_tokenizer_cannot_do_is_refused(tiny_model_dir, foreign_draft, tmp_path):
    """A cascade stage verifies its inner drafter's target ids: that means nothing for
    another tokenizer, and the error says why; so does a vocab: past the draft's own."""
    from hetero_sd.errors import ConfigError, HeteroSDError

    target = f"model: {tiny_model_dir('llama')}"
    with pytest.raises(ConfigError, match="cascade stage verifies its inner drafter's token ids"):
        _from_yaml(tmp_path, target, f"kind: ngram, k: 3, stages: [{{model: {foreign_draft}, k: 2}}]")
    with pytest.raises(HeteroSDError, match=f"outside 1..{DRAFT_VOCAB}"):
        _from_yaml(tmp_path, target, f"kind: model, model: {foreign_draft}, vocab: {DRAFT_VOCAB + 1}")


def test_a_draft_of_another_tokenizer_with_a_restricted_head(tiny_model_dir, foreign_draft, tmp_path):
    """vocab: N restricts a draft of another tokenizer to its own first N ids (a cheaper
    head): the bridge maps those alone, and greedy output stays the target's for k = 1..8
    (sampling: test_a_restricted_head_keeps_the_target_distribution)."""
    from helpers.tiny_models import make_tokenizer

    engine = _from_yaml(tmp_path, f"model: {tiny_model_dir('llama')}, backend: onnxruntime, precision: int4",
                        f"kind: model, model: {foreign_draft}, backend: onnxruntime, precision: fp32, "
                        "vocab: 200, k: 3")
    drafter = engine._drafter.default
    assert isinstance(drafter, CrossVocabDrafter)
    assert drafter.runner.vocab_size == 200 == len(drafter.bridge.to_target) and drafter.bridge.shared.any()
    prompt = make_tokenizer().encode("The capital of France is Paris. How many legs", add_special_tokens=False)
    _assert_lossless_for_every_k(engine, prompt, 40)


def test_vocabularies_that_share_nothing_are_refused():
    from hetero_sd.errors import ConfigError

    with pytest.raises(ConfigError, match="share no token"):
        VocabBridge(LetterCodec("abc"), LetterCodec("xyz"), 3, 3)


@pytest.mark.parametrize("draft", ["same-tokenizer", "foreign"])
def test_a_draft_model_runs_unpadded_beside_a_padded_target(tiny_model_dir, foreign_draft, tmp_path, monkeypatch,
                                                          draft):
    """A draft's runner is told it drafts (Runner.draft_only): where the target pads its
    one-token calls for exactness, the draft's run unpadded (cheaper), and the output is
    still the target's own, k = 1..8."""
    from hetero_sd.backends import row_check
    from helpers.tiny_models import make_tokenizer

    monkeypatch.setenv("HETERO_SD_PAD_SINGLE_ROW", "1")  # the old switch: read when the config loads
    model = tiny_model_dir("llama")
    engine = _from_yaml(tmp_path, f"model: {model}, backend: onnxruntime, precision: int4",
                        f"kind: model, model: {foreign_draft if draft == 'foreign' else model}, "
                        f"backend: onnxruntime, precision: int4, k: 3")
    assert engine.target_runner.pads_single_row and not engine.drafter.runner.pads_single_row
    assert "draft_only" in engine.drafter.runner.kernel_choice
    prompt = make_tokenizer().encode("The capital of France is Paris. How many legs", add_special_tokens=False)
    _assert_lossless_for_every_k(engine, prompt, 32)


class _ShortMatches:
    """A suffix drafter whose match is always short (one token)."""

    match_len = 1

    def draft(self, req, rnd=None):
        from hetero_sd.ir.work import DraftResult

        return DraftResult(req.seq_id, [7][:req.k], None)


class _Refused:
    """A head or draft model whose drafts the target never accepts; counts its drafting rounds."""

    feature_layers = ()

    def __init__(self):
        self.rounds = 0

    def draft(self, req, rnd=None):
        from hetero_sd.ir.work import DraftResult

        self.rounds += req.k > 0
        return DraftResult(req.seq_id, [5] * req.k, None)


def test_a_hybrid_gates_a_head_by_its_rate_but_not_a_draft_model():
    """A head whose drafts are refused is soon passed over for short suffix matches (its
    running rate falls below min_head_rate); a draft model (min_head_rate None, as
    build() makes it for hybrid_with: model) drafts in every round without a long match."""
    from hetero_sd.drafting.hybrid import HybridDrafter
    from hetero_sd.ir.work import DraftRequest

    rounds = {}
    for gate in (0.35, None):
        head = _Refused()
        hybrid = HybridDrafter(_ShortMatches(), head, min_match=4, min_head_rate=gate)
        for _ in range(40):
            hybrid.draft(DraftRequest(0, 10, 3, [], context=list(range(10))))
            hybrid.observe(3, 0)
        rounds[gate] = head.rounds
    assert rounds[None] == 40 and rounds[0.35] < 10, rounds


def test_build_ungates_a_hybrid_draft_model(tiny_model_dir, foreign_draft, tmp_path):
    engine = _from_yaml(tmp_path, f"model: {tiny_model_dir('llama')}",
                        f"kind: hybrid, hybrid_with: model, model: {foreign_draft}, k: 3")
    assert engine._drafter.default.min_head_rate is None


def test_a_hybrids_lookup_rounds_do_not_price_a_draft_step(tiny_model_dir, tmp_path):
    """min_prob: auto prices a draft step from the rounds' drafting time; a hybrid's
    suffix round takes microseconds, so it marks its result a lookup and the round's time
    is kept out of that price (it would price the draft model's steps at near nothing),
    while the draft model's rounds pass theirs. Output stays the target's."""
    from helpers.tiny_models import make_tokenizer

    model = tiny_model_dir("llama")
    engine = _from_yaml(tmp_path, f"model: {model}", f"kind: hybrid, hybrid_with: model, model: {model}, k: 4, "
                        "hybrid_min_match: 2, min_prob: auto")
    hybrid, seen, served = engine._drafter.default, [], [None]
    observe, draft = engine.policy.observe, hybrid.draft

    def spy_observe(rnd):
        # (the draft seconds the policy prices by; which drafter served the round's drafts)
        seen.append((rnd.drafted, rnd.priced_draft_s, served[0]))
        served[0] = None
        observe(rnd)

    def spy_draft(req, rnd=None):
        before = dict(hybrid.picks)
        got = draft(req, rnd)
        served[0] = "suffix" if hybrid.picks["suffix"] > before["suffix"] else \
            "model" if hybrid.picks["head"] > before["head"] else None
        assert rnd.lookup == (served[0] == "suffix")
        return got

    engine.policy.observe, hybrid.draft = spy_observe, spy_draft
    prompt = make_tokenizer().encode("red green blue, red green blue, red green blue, red green blue, red green",
                                     add_special_tokens=False)
    alone = engine.generate_ids(prompt, 48, target_only=True).token_ids
    assert engine.generate_ids(prompt, 48).token_ids == alone
    rounds = [(draft_s, kind) for drafted, draft_s, kind in seen if drafted]
    assert {kind for _, kind in rounds} == {"suffix", "model"}, seen
    assert all(draft_s is None for draft_s, kind in rounds if kind == "suffix")
    assert all(draft_s is not None and draft_s > 0 for draft_s, kind in rounds if kind == "model")
