"""Lossless: greedy speculative output is token-identical to target-only
decoding on the same backend, for both drafters, k in 1..8, many seeds and
prompt lengths. CPU precisions are batch-invariant (proven bitwise in
tests/backends), so the expected number of divergences is zero, and any
divergence fails with the near-tie gap printed for diagnosis."""
from __future__ import annotations

import pytest

from hetero_sd.backends.torch_backend import TorchBackend
from hetero_sd.drafting import ModelDrafter, NgramDrafter
from hetero_sd.engine import Engine
from hetero_sd.sampling import accept_greedy
from hetero_sd.ir import load_model_ir
from helpers.tiny_models import random_prompt

BACKEND = TorchBackend()
PRECISIONS = [p.name for p in BACKEND.probe()[0].precisions]


def _load(folder, precision="fp32"):
    return BACKEND.load(load_model_ir(folder), "cpu", precision, 4 << 20)


def _repetitive_prompt(n: int, seed: int) -> list[int]:
    """Random tokens with a repeated stretch, so prompt lookup finds matches."""
    head = random_prompt(max(4, n // 2), seed=seed)
    return (head + head)[:n]


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _assert_identical(engine, prompt, max_new, label):
    base = engine.generate_ids(prompt, max_new, target_only=True)
    spec = engine.generate_ids(prompt, max_new)
    assert spec.token_ids == base.token_ids, (
        f"{label}: speculative output diverges from target-only at token "
        f"{_first_divergence(spec.token_ids, base.token_ids)}")
    assert spec.stats.finish_reason == base.stats.finish_reason
    return spec.stats


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("variant", ["llama", "qwen2", "mistral-swa"])
def test_ngram_drafter_lossless(tiny_model_dir, variant, precision):
    target = _load(tiny_model_dir(variant), precision)
    drafted = accepted = 0
    for k in range(1, 9):
        engine = Engine(target, NgramDrafter(1, 3), k=k, eos_ids=())
        for seed in range(3):
            n = 5 + 11 * seed + k
            stats = _assert_identical(engine, _repetitive_prompt(n, seed + 10 * k), 24 + 5 * seed,
                                      f"{variant} {precision} k={k} seed={seed}")
            drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    # The test must exercise both accepted and rejected drafts to mean anything.
    assert accepted > 0 and drafted > accepted


@pytest.mark.parametrize("precision", PRECISIONS)
def test_model_drafter_lossless(tiny_model_dir, precision):
    target = _load(tiny_model_dir("llama"), precision)
    drafts = {
        "other model": _load(tiny_model_dir("llama", seed=1), "fp32"),  # mostly rejected
        "same model": _load(tiny_model_dir("llama"), PRECISIONS[-1]),  # mostly accepted
    }
    for name, runner in drafts.items():
        drafted = accepted = 0
        for k in range(1, 9):
            engine = Engine(target, ModelDrafter(runner, target.vocab_size), k=k)
            for seed in range(2):
                stats = _assert_identical(engine, random_prompt(3 + 9 * seed + k, seed=100 + k + seed),
                                          20 + 7 * seed, f"{name} {precision} k={k} seed={seed}")
                drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
        assert drafted > 0
        if name == "same model":
            assert accepted / drafted > 0.5
        else:
            assert drafted > accepted


def test_stops_identically(tiny_model_dir):
    """EOS and the token budget end both modes at the same token."""
    target = _load(tiny_model_dir("llama"))
    prompt = _repetitive_prompt(20, 5)
    free = Engine(target, NgramDrafter(1, 3), k=4).generate_ids(prompt, 30, target_only=True).token_ids
    eos = free[11]  # pretend a token the model emits is EOS
    engine = Engine(target, NgramDrafter(1, 3), k=4, eos_ids=(eos,))
    base = engine.generate_ids(prompt, 30, target_only=True)
    spec = engine.generate_ids(prompt, 30)
    assert spec.token_ids == base.token_ids == free[:free.index(eos)]
    assert spec.stats.finish_reason == "eos"
    for budget in (1, 2, 7):
        assert len(engine.generate_ids(prompt, budget).token_ids) <= budget


def test_stop_strings_identical(tiny_model_dir):
    folder = tiny_model_dir("llama")
    ir = load_model_ir(folder)
    target = BACKEND.load(ir, "cpu", "fp32", 4 << 20)
    tok = ir.load_tokenizer()
    prompt = _repetitive_prompt(16, 9)
    plain = Engine(target, None, tokenizer=tok).generate_ids(prompt, 30, target_only=True)
    stop = plain.text[len(plain.text) // 2:][:3]
    if not stop.strip():
        pytest.fail("test setup: pick a non-blank stop string")
    engine = Engine(target, NgramDrafter(1, 3), k=5, tokenizer=tok, stop=(stop,))
    base, spec = engine.generate_ids(prompt, 30, target_only=True), engine.generate_ids(prompt, 30)
    assert spec.token_ids == base.token_ids and spec.text == base.text
    assert base.stats.finish_reason == "stop" and stop not in base.text


def test_accept_greedy_glossary():
    drafts = [1, 2, 3]  # verified after the last committed token, so the target scores 4 rows
    assert accept_greedy(drafts, [1, 2, 9, 4]) == (2, [1, 2, 9])  # 2 accepted + correction
    assert accept_greedy(drafts, [1, 2, 3, 4]) == (3, [1, 2, 3, 4])  # all accepted + bonus 4
    assert accept_greedy(drafts, [5, 2, 3, 4]) == (0, [5])
    assert accept_greedy([], [8]) == (0, [8])  # no drafts: plain decode


def test_smollm2_lossless(smollm2_gguf):
    """The real embedded model, both drafters, on prompts that make lookup pay."""
    ir = load_model_ir(smollm2_gguf)
    target = BACKEND.load(ir, "cpu", "fp32", 64 << 20)
    tok = ir.load_tokenizer()
    text = ("Copy exactly: The motor stops automatically after 60 seconds to prevent overheating. "
            "If the grinder stops early, let it cool for ten minutes.")
    prompt = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                     tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    for k in (3, 5):
        stats = _assert_identical(Engine(target, NgramDrafter(), k=k), prompt, 40, f"smollm2 ngram k={k}")
        assert stats.accepted > 0
    draft = BACKEND.load(ir, "cpu", PRECISIONS[-1], 64 << 20)
    _assert_identical(Engine(target, ModelDrafter(draft, target.vocab_size), k=4), prompt, 24,
                      "smollm2 model drafter")
