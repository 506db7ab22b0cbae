"""A GGUF target and a GGUF draft at the files' own quantization (precision
`gguf`), the shape of the Qwen2.5-Coder 1.5B / 0.5B pair in tiny: a Q4_K_M
target and a draft of other block types, on both graph runtimes. Greedy
speculative output equals target-only for k = 1..8; a draft whose LM head
scores only the first N token ids (`vocab:`) stays lossless, greedy and
sampled; seeded sampling reproduces."""
from __future__ import annotations

import numpy as np
import pytest

from hetero_sd.backends.registry import discover
from hetero_sd.drafting import ModelDrafter
from hetero_sd.engine import Engine
from hetero_sd.errors import ConfigError
from hetero_sd.ir import load_model_ir
from hetero_sd.sampling import SamplingParams
from helpers.tiny_models import random_prompt

REGISTRY = discover()
RUNTIMES = ["onnxruntime", "openvino"]


def _load(path, backend, vocab=None, precision="gguf"):
    return REGISTRY.get(backend).load(load_model_ir(path).with_output_vocab(vocab), "cpu", precision, 4 << 20)


@pytest.fixture(scope="module")
def pair(tiny_gguf):
    """A Q4_K_M target and a draft of the same weights in other block types (Q4_0 .. Q8_0)."""
    return tiny_gguf("qwen2-wide", "Q4_K_M"), tiny_gguf("qwen2-wide", "LEGACY")


@pytest.mark.parametrize("target_backend", RUNTIMES)
@pytest.mark.parametrize("draft_backend", RUNTIMES)
def test_gguf_pair_greedy_is_lossless_for_every_k(pair, target_backend, draft_backend):
    target = _load(pair[0], target_backend)
    draft = _load(pair[1], draft_backend)
    drafted = accepted = 0
    for k in range(1, 9):
        prompt = random_prompt(6 + k, seed=100 + k)
        engine = Engine(target, ModelDrafter(draft, target.vocab_size), k=k)
        base = engine.generate_ids(prompt, 20, target_only=True)
        spec = engine.generate_ids(prompt, 20)
        assert spec.token_ids == base.token_ids, f"k={k}"
        drafted, accepted = drafted + spec.stats.drafted, accepted + spec.stats.accepted
    assert 0 < accepted < drafted  # the draft is a different model: some rejected, some kept


@pytest.mark.parametrize("backend", RUNTIMES)
def test_restricted_draft_head_scores_the_first_ids_and_stays_lossless(pair, backend):
    target = _load(pair[0], "onnxruntime")
    full, cut = _load(pair[1], backend), _load(pair[1], backend, vocab=200)
    assert cut.vocab_size == 200 and full.vocab_size == target.vocab_size == 384
    prompt = random_prompt(12, seed=3)
    a, b = full.forward(full.allocate(16), prompt, 0, 3), cut.forward(cut.allocate(16), prompt, 0, 3)
    assert np.allclose(a[:, :200], b, atol=1e-5 * np.abs(a).max())  # the same rows of the same head
    accepted = 0
    for k in (1, 3, 6):
        engine = Engine(target, ModelDrafter(cut, target.vocab_size, head_vocab=200), k=k)
        base = engine.generate_ids(prompt, 24, target_only=True)
        spec = engine.generate_ids(prompt, 24)
        assert spec.token_ids == base.token_ids, k
        accepted += spec.stats.accepted
    assert accepted > 0


def test_restricted_head_sampling_reproduces_and_keeps_q_on_the_target_vocab(pair):
    target, cut = _load(pair[0], "onnxruntime"), _load(pair[1], "onnxruntime", vocab=200)
    drafter = ModelDrafter(cut, target.vocab_size, head_vocab=200)
    params = SamplingParams(temperature=0.8, top_k=0, top_p=1.0, seed=11)
    engine = Engine(target, drafter, k=4, sampling=params)
    prompt = random_prompt(10, seed=9)
    first, again = engine.generate_ids(prompt, 24), engine.generate_ids(prompt, 24)
    assert first.token_ids == again.token_ids and first.stats.drafted > 0


def test_restricted_head_errors_name_the_mismatch(pair):
    target = _load(pair[0], "onnxruntime")
    cut = _load(pair[1], "onnxruntime", vocab=200)
    with pytest.raises(ConfigError, match="vocabulary of 200 tokens but the target has 384"):
        ModelDrafter(cut, target.vocab_size)
    with pytest.raises(ConfigError, match="vocab 500 exceeds the target's vocabulary of 384"):
        ModelDrafter(cut, target.vocab_size, head_vocab=500)
    from hetero_sd.errors import HeteroSDError

    with pytest.raises(HeteroSDError, match="outside 1..384"):
        load_model_ir(pair[1]).with_output_vocab(0)
    with pytest.raises(HeteroSDError, match="torch: a restricted output vocabulary"):
        _load(pair[1], "torch", vocab=200, precision="fp32")


def test_vocab_key_in_yaml_reaches_the_draft(pair, tmp_path):
    from hetero_sd.config import load_config

    path = tmp_path / "pair.yaml"
    path.write_text(f"target: {{model: {pair[0]}, backend: onnxruntime, precision: gguf}}\n"
                    f"drafter: {{kind: model, model: {pair[1]}, backend: onnxruntime, precision: gguf, vocab: 200, k: 3}}\n"
                    "generation: {max_new_tokens: 12, chat_template: false}\n")
    engine = Engine.from_config(load_config(path))
    try:
        assert engine.drafter.runner.vocab_size == 200
        out = engine.generate_ids(random_prompt(8, seed=1), 12)
        assert out.token_ids == engine.generate_ids(random_prompt(8, seed=1), 12, target_only=True).token_ids
    finally:
        engine.close()
    # a hybrid's draft model takes the key too: suffix drafts on long matches, the cut draft elsewhere
    path.write_text(f"target: {{model: {pair[0]}, backend: onnxruntime, precision: gguf}}\n"
                    f"drafter: {{kind: hybrid, hybrid_with: model, model: {pair[1]}, backend: onnxruntime, "
                    "precision: gguf, vocab: 200, k: 3}\n"
                    "generation: {max_new_tokens: 12, chat_template: false}\n")
    engine = Engine.from_config(load_config(path))
    try:
        assert engine._drafter.default.head.runner.vocab_size == 200
        res = engine.generate_ids(random_prompt(8, seed=2), 12)
        assert res.token_ids == engine.generate_ids(random_prompt(8, seed=2), 12, target_only=True).token_ids
        assert res.stats.drafted > 0
    finally:
        engine.close()
    bad = tmp_path / "bad.yaml"
    for drafter in ("{kind: ngram, vocab: 200}", "{kind: hybrid, vocab: 200}"):  # (a hybrid's head: no)
        bad.write_text(f"drafter: {drafter}\n")
        with pytest.raises(ConfigError, match="drafter.vocab restricts a draft model's LM head"):
            load_config(bad)
