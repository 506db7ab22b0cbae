"""The cuda backend's runner through whole models of every family (on the GPU where one
is, else the same kernels interpreted): logits against transformers, greedy ids equal
to transformers' generate at fp32, bitwise batch invariance (a decode row equals the
same row in a verify, and in a call of several sequences), and lossless speculation
with the n-gram and draft-model drafters, k = 1..8 (one k a drafter a family, every
k of each drafter over the families: the interpreter runs a call in about 0.25 s,
so the matrix is spread).

Tolerance at fp32: 1e-4 absolute (float reassociation only; torch's fp32 reference
has the same bound in tests/backends/test_families.py)."""
from __future__ import annotations

import numpy as np
import pytest

from hetero_sd.backends.base import BatchItem
from hetero_sd.backends.cuda.backend import CudaBackend
from hetero_sd.backends.cuda.ops import Blocks
from hetero_sd.drafting import ModelDrafter, NgramDrafter
from hetero_sd.engine import Engine
from hetero_sd.ir import load_model_ir
from hetero_sd.sampling import SamplingParams
from helpers.lossless import assert_lossless, greedy_ids, load_runner
from helpers.tiny_models import FAMILY_VARIANTS, HF_ONLY_VARIANTS, hf_generate, hf_logits, random_prompt

from .conftest import cuda_device

VARIANTS = ("llama", "mistral-swa", "qwen2") + FAMILY_VARIANTS + HF_ONLY_VARIANTS


def cuda_runner(path, precision: str = "fp32", budget: int = 4 << 20):
    return CudaBackend().load(load_model_ir(path), cuda_device(), precision, budget)


def _verify_rows_equal_decode(runner, context: int, width: int, what: str) -> None:
    seq = runner.allocate(context + width + 2)
    prompt, cont = random_prompt(context, seed=context), random_prompt(width, seed=context + 1)
    runner.forward(seq, prompt, 0, 1)
    single = np.stack([runner.forward(seq, [t], context + i, 1)[0] for i, t in enumerate(cont)])
    for k in range(1, width + 1):
        runner.truncate(seq, context)  # rollback is a length
        rows = runner.forward(seq, cont[:k], context, k)
        assert np.array_equal(rows, single[:k]), f"{what} context {context}: a {k}-row verify differs"
    runner.release(seq)


@pytest.mark.parametrize("variant", VARIANTS)
def test_family_matches_transformers(tiny_model_dir, variant):
    folder = tiny_model_dir(variant)
    runner = cuda_runner(folder)
    assert runner.precision.batch_invariant
    prompt = random_prompt(10, seed=3)
    ref = hf_logits(folder, prompt).numpy()
    got = runner.forward(runner.allocate(16), prompt, 0, len(prompt))
    assert np.abs(got - ref).max() <= 1e-4, f"{variant}: max |diff| {np.abs(got - ref).max():.3g}"
    assert np.array_equal(got.argmax(-1), ref.argmax(-1))
    want = hf_generate(folder, prompt[:6], 4)  # shorter where it ends at the end token
    assert greedy_ids(runner, prompt[:6], 4)[:len(want)] == want
    _verify_rows_equal_decode(runner, 30, 3, variant)  # past Gemma's and Mistral's windows of 8


@pytest.mark.parametrize("precision", ["bf16"])  # fp16's kernels: test_kernels.py
def test_half_precisions(tiny_model_dir, precision):
    """bf16 within half a logit spread of transformers' fp32 (one rounding of weights
    and activations), and as batch-invariant as fp32."""
    folder = tiny_model_dir("qwen3")
    runner = cuda_runner(folder, precision)
    prompt = random_prompt(12, seed=4)
    ref = hf_logits(folder, prompt).numpy()
    got = runner.forward(runner.allocate(16), prompt, 0, len(prompt))
    assert np.abs(got - ref).max() <= 0.5 * ref.std()
    _verify_rows_equal_decode(runner, 20, 5, f"qwen3 {precision}")


def test_batches_of_sequences(tiny_model_dir):
    """A row's logits are bitwise the same alone, in a verify, and in calls of 2, 5 and 16
    sequences of mixed lengths (prefills among them); copy_prefix writes what a prefill
    writes; the pool reports its use."""
    runner = cuda_runner(tiny_model_dir("llama"), budget=8 << 20)
    prompts = [random_prompt(2 + (i * 3) % 7, seed=100 + i) for i in range(16)]
    conts = [random_prompt(1 + i % 3, seed=200 + i) for i in range(16)]
    alone = []
    for p, c in zip(prompts, conts):
        seq = runner.allocate(32)
        runner.forward(seq, p, 0, 1)
        alone.append(runner.forward(seq, c, len(p), len(c)))
        runner.release(seq)
    for width in (2, 5, 16):
        seqs = [runner.allocate(32) for _ in range(width)]
        first = runner.forward_batch([BatchItem(s, prompts[i], 0, 1) for i, s in enumerate(seqs)])
        rows = runner.forward_batch([BatchItem(s, conts[i], len(prompts[i]), len(conts[i]))
                                     for i, s in enumerate(seqs)])
        assert len(first) == width
        for i in range(width):
            assert np.array_equal(rows[i], alone[i]), f"sequence {i} of a batch of {width}"
        assert runner.usage().sequences == width
        for s in seqs:
            runner.release(s)
    src, dst = runner.allocate(32), runner.allocate(32)
    runner.forward(src, prompts[5], 0, 1)
    runner.copy_prefix(src, dst, len(prompts[5]))
    assert runner.length(dst) == len(prompts[5])
    assert np.array_equal(runner.forward(dst, conts[5], len(prompts[5]), len(conts[5])), alone[5])
    use = runner.usage()
    assert use.sequences == 2 and use.filled_tokens == 2 * len(prompts[5]) + len(conts[5])


def test_features_match_the_reference(tiny_model_dir):
    """Hidden states for an EAGLE-3 head: those of the torch backend's fp32 reference."""
    folder = tiny_model_dir("llama")
    ir = load_model_ir(folder).with_features((0, 1))
    runner = CudaBackend().load(ir, cuda_device(), "fp32", 4 << 20)
    ref = load_runner("torch", folder)
    ref_ir_runner = type(ref)(ir, ref.device, ref.precision, 4 << 20)
    prompt = random_prompt(9, seed=8)
    runner.forward(s := runner.allocate(16), prompt, 0, 1)
    ref_ir_runner.forward(r := ref_ir_runner.allocate(16), prompt, 0, 1)
    got, want = runner.take_features(s), ref_ir_runner.take_features(r)
    assert got.shape == want.shape == (9, 2 * 64)
    assert np.abs(got - want).max() <= 1e-4
    assert runner.take_features(s) is None  # forgotten once taken


@pytest.mark.parametrize("variant", VARIANTS)
def test_speculation_is_lossless(tiny_model_dir, variant):
    target = cuda_runner(tiny_model_dir(variant))
    drafts = {seed: load_runner("torch", tiny_model_dir(variant, seed=seed)) for seed in (0, 1)}
    i = VARIANTS.index(variant)
    k_ngram = 1 + i % 8  # over the families, every k for each drafter
    stats = [assert_lossless(Engine(target, NgramDrafter(1, 3), k=k_ngram), random_prompt(3 + i, seed=i) * 2, 4,
                             f"{variant} ngram k={k_ngram}")]
    # odd k: the target's own weights draft (accepted); even k: another seed's (rejected)
    for seed, k in ((0, 1 + 2 * (i % 4)), (1, 2 + 2 * ((i + 1) % 4))):
        model = ModelDrafter(drafts[seed], target.vocab_size)
        stats.append(assert_lossless(Engine(target, model, k=k), random_prompt(6 + i, seed=40 + i + k), 4,
                                     f"{variant} draft model (seed {seed}) k={k}"))
    drafted, accepted = sum(s.drafted for s in stats), sum(s.accepted for s in stats)
    assert 0 < accepted < drafted  # both accepting and rejecting paths ran


def test_seeded_sampling_reproduces(tiny_model_dir):
    target = cuda_runner(tiny_model_dir("qwen2"))
    engine = Engine(target, NgramDrafter(1, 3), k=4)
    prompt = random_prompt(6, seed=5) * 2
    runs = [engine.generate_ids(prompt, 6, sampling=SamplingParams(temperature=1.0, seed=s)).token_ids
            for s in (11, 11, 12)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]  # the seed is used (6 tokens at temperature 1 over 384)


def test_gguf_blocks_target(tiny_gguf, tiny_roundtrip_dir):
    """precision gguf computes with the file's own Q4_K / Q6_K blocks (the matmul itself
    is checked against them in test_kernels.py): within bf16's bound of transformers on
    the round-tripped weights (its activations are bf16: half the logit spread, as for
    bf16 in tests/backends/test_families.py), and lossless under speculation."""
    path = tiny_gguf("llama-wide", "Q4_K_M")
    runner = cuda_runner(path, "gguf")
    kinds = {w.kind for w in runner._forward.w.values() if isinstance(w, Blocks)}
    assert {"Q4_K", "Q6_K"} <= kinds
    prompt = random_prompt(10, seed=6)
    ref = hf_logits(tiny_roundtrip_dir("llama-wide", "Q4_K_M"), prompt).numpy()
    got = runner.forward(runner.allocate(16), prompt, 0, len(prompt))
    assert np.abs(got - ref).max() <= 0.5 * ref.std()
    assert_lossless(Engine(runner, NgramDrafter(1, 3), k=3), random_prompt(5, seed=3) * 2, 5, "gguf k=3")


def test_drafting_during_the_verify_is_lossless(tiny_model_dir):
    """scheduler.overlap on (interpreted, the runner is synchronous and `on` forces the
    pre-draft path; on a GPU its submit is asynchronous and auto overlaps): a draft model on
    the torch CPU runner with the target's own weights (k = 5: pre-drafts hit) and another
    seed's (k = 2: rejected), and seeded sampling with one-hot drafts equal to target-only's.
    (k = 1..8 for every drafter kind runs on the table model: tests/hetero_sd/test_overlap.py.)"""
    target = cuda_runner(tiny_model_dir("llama"))
    prompt = random_prompt(8, seed=61)
    hits = 0
    for seed, k in ((0, 5), (1, 2)):
        drafter = ModelDrafter(load_runner("torch", tiny_model_dir("llama", seed=seed)), target.vocab_size)
        engine = Engine(target, drafter, k=k, overlap="on")
        assert engine.overlap().on
        stats = assert_lossless(engine, prompt, 10, f"overlap k={k} draft seed {seed}")
        hits += stats.predraft_hits
    assert hits > 0  # round r+1's drafts came from the pre-draft
    params = SamplingParams(temperature=1.0, seed=7)
    on = Engine(target, NgramDrafter(1, 3), k=3, overlap="on").generate_ids(prompt * 2, 6, sampling=params)
    alone = Engine(target, None).generate_ids(prompt * 2, 6, sampling=params, target_only=True)
    assert on.token_ids == alone.token_ids  # one-hot drafts: seeded sampling is target-only's
