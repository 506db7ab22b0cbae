"""Lossless on every family and backend: greedy speculative ids equal
target-only ids for the n-gram and the draft-model drafters, k = 1..8 (a
MoE target's routing included), and seeded sampling reproduces. Each
family's own model drafts for it: its target weights (seed 0: long accepted
runs) on odd k, another seed's (mostly rejected) on even k."""
from __future__ import annotations

import pytest

from helpers.lossless import assert_lossless, load_runner
from hetero_sd.drafting import ModelDrafter, NgramDrafter
from hetero_sd.engine import Engine
from hetero_sd.sampling import SamplingParams
from helpers.tiny_models import FAMILY_VARIANTS, random_prompt

BACKENDS = ["torch", "onnxruntime", "openvino"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", FAMILY_VARIANTS)
def test_speculation_is_lossless(tiny_model_dir, variant, backend):
    target = load_runner(backend, tiny_model_dir(variant))
    drafts = {seed: load_runner("torch", tiny_model_dir(variant, seed=seed)) for seed in (0, 1)}
    drafted = accepted = 0
    for k in range(1, 9):
        head = random_prompt(5 + k, seed=k)
        stats = assert_lossless(Engine(target, NgramDrafter(1, 3), k=k), head * 2, 16, f"{variant} ngram -> {backend} k={k}")
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
        model = ModelDrafter(drafts[k % 2 == 0], target.vocab_size)
        stats = assert_lossless(Engine(target, model, k=k), random_prompt(6 + k, seed=40 + k), 16,
                      f"{variant} draft model (seed {int(k % 2 == 0)}) -> {backend} k={k}")
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    assert 0 < accepted < drafted  # both accepting and rejecting paths ran


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
@pytest.mark.parametrize("variant", FAMILY_VARIANTS)
def test_seeded_sampling_reproduces(tiny_model_dir, variant, backend):
    target = load_runner(backend, tiny_model_dir(variant))
    engine = Engine(target, NgramDrafter(1, 3), k=4)
    prompt = random_prompt(8, seed=5) * 2
    runs = [engine.generate_ids(prompt, 20, sampling=SamplingParams(temperature=1.0, seed=s)).token_ids
            for s in (11, 11, 12)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]  # the seed is used (20 tokens at temperature 1 over 384)


@pytest.mark.parametrize("backend,precision", [("onnxruntime", "gguf"), ("openvino", "gguf")])
@pytest.mark.parametrize("variant", FAMILY_VARIANTS)
def test_gguf_targets_are_lossless(tiny_gguf, variant, backend, precision):
    target = load_runner(backend, tiny_gguf(variant, "Q8_0"), precision)
    for k in (1, 3, 8):
        head = random_prompt(6 + k, seed=60 + k)
        assert_lossless(Engine(target, NgramDrafter(1, 3), k=k), head * 2, 16, f"{variant} GGUF {backend} {precision} k={k}")
