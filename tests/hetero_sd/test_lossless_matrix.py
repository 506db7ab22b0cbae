"""Lossless across runtimes: for every (draft backend, target backend) pair in
{torch, onnxruntime, openvino}^2, with every drafter, greedy speculative ids
equal target-only ids on the target's backend. All three targets run
batch-invariant precisions, so zero divergences is the expected result."""
from __future__ import annotations

import pytest

from helpers.lossless import assert_lossless, load_runner
from hetero_sd.drafting import ModelDrafter, NgramDrafter, SuffixDrafter
from hetero_sd.engine import Engine
from helpers.tiny_models import random_prompt

BACKENDS = ["torch", "onnxruntime", "openvino"]


@pytest.mark.parametrize("target_backend", BACKENDS)
def test_ngram_any_target(tiny_model_dir, target_backend):
    target = load_runner(target_backend, tiny_model_dir("qwen2"))
    drafted = accepted = 0
    for k in (1, 2, 3, 5, 8):
        for seed in range(3):
            head = random_prompt(6 + 3 * seed, seed=seed + 7 * k)
            stats = assert_lossless(Engine(target, NgramDrafter(1, 3), k=k), head * 2, 24,
                           f"ngram -> {target_backend} k={k} seed={seed}")
            drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    assert 0 < accepted < drafted


@pytest.mark.parametrize("target_backend", ["onnxruntime", "openvino"])  # torch: tests/hetero_sd/test_suffix.py
def test_suffix_any_target(tiny_model_dir, target_backend):
    """One drafter per k, a prompt twice: the second time the global tree
    (earlier outputs) drafts as well."""
    target = load_runner(target_backend, tiny_model_dir("qwen2"))
    drafted = accepted = 0
    for k in (1, 2, 3, 5, 8):
        engine = Engine(target, SuffixDrafter(), k=k)
        for seed in (0, 1, 0):
            head = random_prompt(6 + 3 * seed, seed=seed + 7 * k)
            stats = assert_lossless(engine, head * 2 if seed else head, 24, f"suffix -> {target_backend} k={k} seed={seed}")
            drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    assert 0 < accepted < drafted


@pytest.mark.parametrize("target_backend", BACKENDS)
@pytest.mark.parametrize("draft_backend", BACKENDS)
def test_draft_model_any_pair(tiny_model_dir, draft_backend, target_backend):
    target = load_runner(target_backend, tiny_model_dir("llama"))
    for draft_seed in (0, 1):  # 0: the target's own weights (mostly accepted); 1: another model
        draft = load_runner(draft_backend, tiny_model_dir("llama", seed=draft_seed))
        drafted = accepted = 0
        for k in (1, 3, 4, 7):
            for seed in range(2):
                stats = assert_lossless(Engine(target, ModelDrafter(draft, target.vocab_size), k=k),
                               random_prompt(5 + 7 * seed, seed=50 + k + seed), 18,
                               f"{draft_backend} draft(seed {draft_seed}) -> {target_backend} k={k}")
                drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
        assert drafted > 0
        assert (accepted / drafted > 0.9) if draft_seed == 0 else (accepted < drafted)


@pytest.mark.parametrize("backend,precision", [("onnxruntime", "int8"), ("onnxruntime", "int4"),
                                               ("openvino", "int8"), ("openvino", "int4")])
def test_quantized_targets_lossless(tiny_model_dir, backend, precision):
    target = load_runner(backend, tiny_model_dir("llama"), precision)
    drafts = {"ngram": NgramDrafter(1, 3), "suffix": SuffixDrafter(),
              "model": ModelDrafter(load_runner("torch", tiny_model_dir("llama")), target.vocab_size)}
    for name, drafter in drafts.items():
        for k in (1, 4, 8):
            for seed in range(2):
                head = random_prompt(8 + 5 * seed, seed=seed + k)
                assert_lossless(Engine(target, drafter, k=k), head * 2, 20, f"{name} -> {backend} {precision} k={k}")


def test_inexact_target_is_reported(tiny_model_dir):
    """A target precision that is not batch-invariant says so on every result."""
    target = load_runner("openvino", tiny_model_dir("llama"), "ov-default")
    result = Engine(target, NgramDrafter(1, 3), k=3).generate_ids(random_prompt(10, seed=1) * 2, 8)
    assert result.stats.lossless == "up to numerics"
    assert "lossless up to numerics" in result.stats.summary()
