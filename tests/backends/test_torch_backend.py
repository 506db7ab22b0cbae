"""The torch backend: parity with the reference, batch invariance, KV pool."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hetero_sd.backends.torch_backend import TorchBackend
from hetero_sd.errors import BackendError, KVBudgetError
from hetero_sd.ir import load_model_ir, reference_logits
from helpers.tiny_models import random_prompt

BACKEND = TorchBackend()
CPU_PRECISIONS = [p.name for p in BACKEND.probe()[0].precisions]


def _runner(model_dir, precision="fp32", budget=1 << 20, device="cpu"):
    return BACKEND.load(load_model_ir(model_dir), device, precision, budget)


@pytest.mark.parametrize("device", ["cpu", "cuda", "npu"])
def test_runner_matches_reference(tiny_model_dir, device):
    """Same code path on every device string; accelerators only where present."""
    if device not in {d.device.split(":")[0] for d in BACKEND.probe()}:
        pytest.skip(f"no {device} device on this host (the cpu case covers the code path)")
    folder = tiny_model_dir("qwen2")
    prompt = random_prompt(30, seed=3)
    ref = reference_logits(load_model_ir(folder), prompt).numpy()
    runner = _runner(folder, device=device, precision=BACKEND.probe()[0].default_precision)
    seq = runner.allocate(64)
    got = runner.forward(seq, prompt, 0, len(prompt))
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)


@pytest.mark.skipif("bf16" not in CPU_PRECISIONS, reason="this CPU has no bf16 matmul support")
def test_bf16_close_to_reference(tiny_model_dir):
    folder = tiny_model_dir("llama")
    prompt = random_prompt(20, seed=4)
    ref = reference_logits(load_model_ir(folder), prompt).numpy()
    runner = _runner(folder, "bf16")
    got = runner.forward(runner.allocate(32), prompt, 0, len(prompt))
    # bf16 keeps 8 mantissa bits: logits of magnitude ~1 carry ~1e-2 error.
    assert np.abs(got - ref).max() < 0.1 * max(1.0, np.abs(ref).max())


@pytest.mark.parametrize("precision", CPU_PRECISIONS)
@pytest.mark.parametrize("variant", ["llama", "mistral-swa", "qwen2"])
def test_verify_rows_equal_single_steps_bitwise(tiny_model_dir, variant, precision):
    """Batch invariance: scoring T tokens in one call gives exactly the logits
    of T one-token calls, for every T a verify can have."""
    runner = _runner(tiny_model_dir(variant), precision)
    seq = runner.allocate(128)
    prompt, cont = random_prompt(12, seed=1), random_prompt(17, seed=2)
    runner.forward(seq, prompt, 0, 1)
    base = len(prompt)
    single = []
    for i, tok in enumerate(cont):
        single.append(runner.forward(seq, [tok], base + i, 1)[0])
    single = np.stack(single)
    for width in range(2, 18):
        runner.truncate(seq, base)
        rows = runner.forward(seq, cont[:width], base, width)
        assert np.array_equal(rows, single[:width]), f"width {width} differs from one-token steps"


def test_truncate_moves_no_kv_data(tiny_model_dir):
    runner = _runner(tiny_model_dir("llama"))
    seq = runner.allocate(64)
    prompt = random_prompt(40, seed=5)
    runner.forward(seq, prompt, 0, 1)
    k, v = runner.kv_buffers()
    ptrs, k_before, v_before = (k.data_ptr(), v.data_ptr()), k.clone(), v.clone()
    runner.truncate(seq, 10)
    assert (k.data_ptr(), v.data_ptr()) == ptrs
    assert torch.equal(k, k_before) and torch.equal(v, v_before)  # not a byte moved or cleared
    assert runner.length(seq) == 10
    assert runner.usage().filled_tokens == 10


def test_rollback_then_rewrite_equals_fresh_run(tiny_model_dir):
    runner = _runner(tiny_model_dir("llama"))
    a, b = random_prompt(20, seed=6), random_prompt(8, seed=7)
    seq = runner.allocate(64)
    runner.forward(seq, a, 0, 1)
    runner.forward(seq, random_prompt(8, seed=8), 20, 8)  # drafts that get rejected
    runner.truncate(seq, 20)
    after_rollback = runner.forward(seq, b, 20, 8)
    fresh = runner.allocate(64)
    runner.forward(fresh, a, 0, 1)
    assert np.array_equal(after_rollback, runner.forward(fresh, b, 20, 8))


def test_pool_budget_and_usage(tiny_model_dir):
    model = load_model_ir(tiny_model_dir("llama"))
    per_token = model.config.kv_bytes_per_token(4)
    runner = BACKEND.load(model, "cpu", "fp32", 100 * per_token)
    usage = runner.usage()
    assert usage.capacity_tokens == 100 and usage.bytes_total == 100 * per_token
    first = runner.allocate(60)
    with pytest.raises(KVBudgetError, match="KV budget exhausted.*memory.kv_budget"):
        runner.allocate(50)
    second = runner.allocate(40)
    assert runner.usage().used_tokens == 100 and runner.usage().sequences == 2
    with pytest.raises(KVBudgetError, match="reserved 40 positions"):
        runner.forward(second, list(range(41)), 0, 1)
    runner.release(first)
    runner.allocate(50)  # released space is reused


def test_unknown_device_and_precision(tiny_model_dir):
    model = load_model_ir(tiny_model_dir("llama"))
    with pytest.raises(BackendError, match="no device 'tpu'.*available: cpu"):
        BACKEND.load(model, "tpu", "fp32", 1 << 20)
    with pytest.raises(BackendError, match="precision 'int3'.*supported: fp32"):
        BACKEND.load(model, "cpu", "int3", 1 << 20)


def test_failed_forward_leaves_sequence_length(tiny_model_dir, monkeypatch):
    runner = _runner(tiny_model_dir("llama"))
    seq = runner.allocate(32)
    runner.forward(seq, random_prompt(5, seed=1), 0, 1)
    monkeypatch.setattr(runner, "_forward", lambda *a: (_ for _ in ()).throw(RuntimeError("oom")))
    with pytest.raises(RuntimeError, match="oom"):
        runner.forward(seq, [1, 2, 3], 5, 3)
    assert runner.length(seq) == 5


def test_gguf_pages_leave_the_resident_set_as_each_weight_loads(tiny_gguf, monkeypatch):
    """A GGUF's mapped pages are dropped after every tensor is converted, so the file
    never counts in memory on top of the weights (the 1.5B in fp32: 8.6 GB peak before,
    7.7 GB after); tensors kept as views of the map still read right (the logits)."""
    path = tiny_gguf("llama", "Q8_0")
    model = load_model_ir(path)
    events = []
    get, release = model.weights.get, model.weights.release_pages
    monkeypatch.setattr(model.weights, "get", lambda name: (events.append("read"), get(name))[1])
    monkeypatch.setattr(model.weights, "release_pages", lambda: (events.append("release"), release())[0])
    runner = BACKEND.load(model, "cpu", "fp32", 1 << 20)
    reads = events.count("read")
    assert reads == len(model.check_weights()) and events == ["read", "release"] * reads
    prompt = random_prompt(12, seed=5)
    got = runner.forward(runner.allocate(16), prompt, 0, len(prompt))
    np.testing.assert_allclose(got, reference_logits(load_model_ir(path), prompt).numpy(), atol=1e-5, rtol=0)
