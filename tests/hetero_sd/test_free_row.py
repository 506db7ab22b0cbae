"""A padded one-token call's free row: where the target runs a one-token call as two rows
(the row check, backends/row_check.py), a greedy request whose policy drafts nothing still
drafts one token from a lookup drafter, as that row costs nothing; the output stays the
target's own. Never for a sampled request (its draft lengths follow acceptance alone), a
model drafter, or an unpadded target. And a round that drafts takes its first draft
however unsure the drafter is (Round.free_rows): min_prob floors do not apply."""
from __future__ import annotations

from hetero_sd.backends.options import BackendOptions, parse_padding
from hetero_sd.backends.registry import discover
from hetero_sd.drafting import NgramDrafter
from hetero_sd.engine import Engine
from hetero_sd.ir import load_model_ir
from hetero_sd.sampling import SamplingParams
from helpers.tiny_models import make_tokenizer, random_prompt


class _Never:
    """A draft-length policy that always says 0 (speculation off)."""

    def next_k(self, remaining: int) -> int:
        return 0

    def observe(self, *args, **kwargs) -> None:
        pass

    def reset(self) -> None:
        pass

    def set_cost(self, cost) -> None:
        pass

    def draft_prices(self):
        return None


def _padded(folder, pad: str):
    """The int4 onnxruntime target with pad_single_row `pad` (1: padded, 0: not)."""
    return discover().get("onnxruntime").load(load_model_ir(folder), "cpu", "int4", 8 << 20,
                                              options=BackendOptions(pad_single_row=parse_padding(pad)))


def _engine(folder, monkeypatch, pad: str) -> Engine:
    target = _padded(folder, pad)
    return Engine(target, NgramDrafter(1, 3), k=4, tokenizer=make_tokenizer())


def _run(engine, prompt, n, sampling=None):
    req = engine.request(prompt, n, sampling=sampling)
    req.policy = _Never()
    req.run()
    return req.close()


def test_the_free_row_drafts_and_stays_lossless(tiny_model_dir, monkeypatch):
    engine = _engine(tiny_model_dir("llama"), monkeypatch, "1")
    assert engine.target_runner.pads_single_row
    drafted = 0
    for seed in range(6):
        prompt = random_prompt(12, seed=300 + seed) * 3  # repeats: the n-gram lookup finds matches
        got = _run(engine, prompt, 24)
        assert got.token_ids == engine.generate_ids(prompt, 24, target_only=True).token_ids
        assert got.stats.drafted == sum(got.stats.drafted_pos[:1]) and len(got.stats.drafted_pos) <= 1  # one a round
        drafted += got.stats.drafted
        sampled = _run(engine, prompt, 24, SamplingParams(temperature=0.9, seed=seed))
        assert sampled.stats.drafted == 0
    assert drafted > 0  # the policy drafted nothing: every draft rode in a free row


def test_a_short_unsure_suffix_match_fills_the_free_row(tiny_model_dir, monkeypatch):
    """The suffix drafter's probability floor and length cap do not apply to a free row's draft."""
    from hetero_sd.drafting.suffix import SuffixDrafter

    drafted = {}
    for pad in ("0", "1"):
        target = _padded(tiny_model_dir("llama"), pad)
        engine = Engine(target, SuffixDrafter(factor=0.01, min_token_prob=1.0), k=4, tokenizer=make_tokenizer())
        drafted[pad] = 0
        for seed in range(4):
            prompt = random_prompt(12, seed=400 + seed) * 3
            req = engine.request(prompt, 24)
            req.policy = _Always(4)
            req.run()
            got = req.close()
            assert got.token_ids == engine.generate_ids(prompt, 24, target_only=True).token_ids
            drafted[pad] += got.stats.drafted
    assert drafted["0"] == 0 < drafted["1"], drafted


class _Always(_Never):
    def __init__(self, k: int):
        self.k = k

    def next_k(self, remaining: int) -> int:
        return min(self.k, remaining)


def test_no_free_row_on_an_unpadded_target(tiny_model_dir, monkeypatch):
    engine = _engine(tiny_model_dir("llama"), monkeypatch, "0")
    assert not engine.target_runner.pads_single_row
    assert _run(engine, random_prompt(12, seed=300) * 3, 24).stats.drafted == 0
