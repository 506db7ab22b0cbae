"""Runner.forward_batch: several sequences' rows in one call, each row bitwise
equal to the same rows run in a call of their own (the lossless condition for
continuous batching), on every backend that declares a batched forward; and
run_batch's fallback for a runner without one."""
from __future__ import annotations

import random

import numpy as np
import pytest

from hetero_sd.backends.base import BatchItem, Runner, run_batch
from hetero_sd.backends.registry import discover
from hetero_sd.ir import load_model_ir
from helpers.native import load_pool_graph
from helpers.tiny_models import random_prompt

REGISTRY = discover()
CASES = [("torch", "fp32", "llama"), ("torch", "fp32", "mistral-swa"),
         ("onnxruntime", "fp32", "llama"), ("onnxruntime", "int4", "llama-tied"),
         ("onnxruntime", "int8", "qwen2"), ("onnxruntime", "fp32", "mistral-swa"),
         # the other families: per-layer windows, MoE routing, NoPE, partial RoPE, q/k norms
         ("torch", "fp32", "gemma3"), ("torch", "fp32", "qwen3-moe"), ("onnxruntime", "fp32", "gemma3"),
         ("onnxruntime", "int4", "mixtral"), ("onnxruntime", "fp32", "phi3"), ("onnxruntime", "int8", "smollm3"),
         ("onnxruntime", "fp32", "qwen3"),
         # the graph that gathers attention from the pool (where SlabAttention cannot run)
         ("onnxruntime:pool", "fp32", "llama"), ("onnxruntime:pool", "int4", "gemma3")]


def _load(backend, folder, precision):
    """backend[:pool]: onnxruntime's graph that gathers attention from the pool."""
    backend, _, graph = backend.partition(":")
    model = load_model_ir(folder)
    if graph == "pool":
        return load_pool_graph(REGISTRY.get(backend), model, "cpu", precision, 8 << 20)
    return REGISTRY.get(backend).load(model, "cpu", precision, 8 << 20)


SIZES = (2, 5, 16, 3, 9)  # sequences a batch, one size a trial


def _batch(runner, rng, trial):
    """SIZES[trial] sequences with random capacities, prompt lengths and row counts."""
    items = []
    for b in range(SIZES[trial]):
        cap = rng.choice([33, 40, 64, 100])
        plen = rng.randint(1, cap - 12)
        seq = runner.allocate(cap)
        runner.forward(seq, random_prompt(plen, seed=trial * 100 + b), 0, 1)
        n = rng.randint(1, 9)
        items.append(BatchItem(seq, random_prompt(n, seed=trial * 1000 + b), plen, n if rng.random() < 0.8
                               else rng.randint(1, n)))
    return items


@pytest.mark.parametrize("backend,precision,variant", CASES)
def test_batched_rows_equal_solo_rows_bitwise(tiny_model_dir, backend, precision, variant):
    runner = _load(backend, tiny_model_dir(variant), precision)
    assert runner.max_batch > 1
    rng = random.Random(7)
    for trial in range(5):
        items = _batch(runner, rng, trial)
        solo = []
        for it in items:
            solo.append(runner.forward(it.seq_id, it.tokens, it.start, it.num_logits))
            runner.truncate(it.seq_id, it.start)
        batched = runner.forward_batch(items)
        for it, a, b in zip(items, solo, batched):
            assert b.shape == (it.num_logits, runner.vocab_size)
            assert np.array_equal(a, b), f"trial {trial}: {len(it.tokens)} rows differ by {np.abs(a - b).max()}"
        # the KV the batch wrote is the KV a solo call writes: the next step agrees too
        nxt = [BatchItem(it.seq_id, [5], it.start + len(it.tokens), 1) for it in items]
        after_batch = runner.forward_batch(nxt)
        for it, want in zip(nxt, after_batch):
            runner.truncate(it.seq_id, it.start)
            assert runner.length(it.seq_id) == it.start
            assert np.array_equal(runner.forward(it.seq_id, it.tokens, it.start, 1), want)
        for it in items:
            runner.release(it.seq_id)


@pytest.mark.parametrize("backend", ["onnxruntime", "onnxruntime:pool"])
def test_failed_batch_claims_no_position(tiny_model_dir, backend):
    """A batch that cannot write (one sequence past its reservation) leaves every
    sequence's length where it was, in either graph."""
    runner = _load(backend, tiny_model_dir("llama"), "fp32")
    a, b = runner.allocate(40), runner.allocate(8)
    runner.forward(a, [1, 2, 3], 0, 1)
    runner.forward(b, [1, 2, 3], 0, 1)
    with pytest.raises(Exception, match="reserved"):
        runner.forward_batch([BatchItem(a, [4, 5], 3, 2), BatchItem(b, list(range(40)), 3, 40)])  # b holds 32 (a whole block)
    assert (runner.length(a), runner.length(b)) == (3, 3)


class _Plain(Runner):
    """A runner that declares no batched forward (Runner's default): run_batch loops over forward."""

    def __init__(self):
        self.calls = []

    def forward(self, seq_id, tokens, start, num_logits):
        self.calls.append(seq_id)
        return np.full((num_logits, 4), float(seq_id))

    def _unused(self, *args):
        raise AssertionError("run_batch calls forward alone")

    allocate = greedy = truncate = length = release = usage = _unused


def test_run_batch_falls_back_to_one_call_per_sequence():
    runner = _Plain()
    assert runner.max_batch == 1
    out = run_batch(runner, [BatchItem(3, [1], 0, 1), BatchItem(9, [1, 2], 0, 2)])
    assert runner.calls == [3, 9]
    assert [o.shape for o in out] == [(1, 4), (2, 4)] and out[1][0, 0] == 9.0


@pytest.mark.parametrize("backend,precision", [("onnxruntime", "fp32"), ("onnxruntime", "int4"),
                                               ("onnxruntime:pool", "int4")])
def test_copied_prefix_equals_computed_prefix_bitwise(tiny_model_dir, backend, precision):
    """onnxruntime's copy_prefix: a sequence given another's first L positions, then
    prefilled from L, scores exactly as one that prefilled the whole prompt (what
    makes the server's prefix cache exact), in either graph."""
    runner = _load(backend, tiny_model_dir("llama"), precision)
    prompt, cont = random_prompt(37, seed=4), random_prompt(6, seed=5)
    whole = runner.allocate(64)
    want = runner.forward(whole, prompt, 0, 1)
    donor = runner.allocate(64)
    runner.forward(donor, prompt[:30] + random_prompt(9, seed=6), 0, 1)  # shares 30 tokens, then differs
    for length in (1, 16, 30):
        seq = runner.allocate(64)
        runner.copy_prefix(donor, seq, length)
        assert runner.length(seq) == length
        assert np.array_equal(runner.forward(seq, prompt[length:], length, 1), want)
        for i, tok in enumerate(cont):  # the continuation agrees too (the KV is the same)
            assert np.array_equal(runner.forward(seq, [tok], 37 + i, 1), runner.forward(whole, [tok], 37 + i, 1))
            runner.truncate(whole, 37 + i)
            runner.forward(whole, [tok], 37 + i, 1)
        runner.truncate(whole, 37)
        runner.release(seq)
    with pytest.raises(ValueError, match="holds"):
        runner.copy_prefix(donor, runner.allocate(64), 40)


def test_onnxruntime_runs_one_graph_for_every_call(tiny_model_dir):
    """On the CPU one graph takes one sequence or many (SlabAttention over the pool):
    nothing to switch before serving, and its description says so."""
    runner = _load("onnxruntime", tiny_model_dir("llama"), "fp32")
    assert runner.max_batch == 32
    assert runner.kernel_choice.startswith("attention by our SlabAttention"), runner.kernel_choice
    assert "any sequences a call" in runner.kernel_choice
    assert not hasattr(runner, "serve_batches")
