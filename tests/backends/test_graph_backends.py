"""onnxruntime and OpenVINO backends (the same ONNX lowering): parity with the
reference, batch invariance, O(1) rollback, the lowered-graph cache."""
from __future__ import annotations

import numpy as np
import pytest

from hetero_sd.backends.registry import discover
from hetero_sd.errors import BackendError, KVBudgetError
from hetero_sd.ir import load_model_ir, reference_logits
from helpers.native import load_pool_graph
from helpers.tiny_models import random_prompt

REGISTRY = discover()
GRAPH_BACKENDS = [name for name in ("onnxruntime", "openvino") if name in REGISTRY.backends]
# (backend, precision, tolerance): fp32 within 1e-4 absolute (float
# reassociation only); lower precisions within a fraction of the logits' spread
# (std ~3 on the tiny models): bf16 keeps 8 mantissa bits, int8/int4 are
# weight-only quantisations of random weights, which int4 hurts most.
# "onnxruntime:pool": its graph that gathers attention from the pool, which a host
# runs where our SlabAttention cannot be built or does not cover the model.
CASES = [("onnxruntime", "fp32", 1e-4), ("onnxruntime", "int8", 0.2), ("onnxruntime", "int4", 1.5),
         ("onnxruntime:pool", "fp32", 1e-4), ("onnxruntime:pool", "int4", 1.5),
         ("openvino", "fp32", 1e-4), ("openvino", "bf16", 0.2), ("openvino", "int8", 0.2),
         ("openvino", "int4", 1.5)]


def _load(backend, folder, precision="fp32", budget=1 << 20):
    backend, _, graph = backend.partition(":")
    if backend not in REGISTRY.backends:
        pytest.fail(f"backend {backend} missing: install the test extra (pip install -e '.[test]')")
    offered = {p.name for info in REGISTRY.get(backend).probe() for p in info.precisions}
    if precision == "bf16" and precision not in offered:  # hardware, not software: fp32 covers the path
        pytest.skip(f"this CPU has no bf16 ({backend} offers {sorted(offered)})")
    if graph == "pool":
        return load_pool_graph(REGISTRY.get(backend), load_model_ir(folder), "cpu", precision, budget)
    return REGISTRY.get(backend).load(load_model_ir(folder), "cpu", precision, budget)


@pytest.mark.parametrize("backend,precision,tol", CASES)
@pytest.mark.parametrize("variant", ["llama-tied", "mistral-swa", "qwen2"])
def test_parity_with_reference(tiny_model_dir, backend, precision, tol, variant):
    folder = tiny_model_dir(variant)
    prompt = random_prompt(30, seed=3)
    ref = reference_logits(load_model_ir(folder), prompt).numpy()
    runner = _load(backend, folder, precision)
    got = runner.forward(runner.allocate(40), prompt, 0, len(prompt))
    bound = tol if precision == "fp32" else tol * ref.std()
    assert np.abs(got - ref).max() <= bound
    # prefill computes the LM head for the requested rows only
    last = runner.forward(runner.allocate(40), prompt, 0, 1)
    assert last.shape == (1, ref.shape[1])


@pytest.mark.parametrize("backend,precision", [(b, p) for b, p, _ in CASES])
def test_batch_invariance_matches_precision_policy(tiny_model_dir, backend, precision):
    """Where the policy says batch-invariant, a verify of width w equals w
    one-token steps bitwise; where it says not, the flag is what users see."""
    runner = _load(backend, tiny_model_dir("llama"), precision)
    seq = runner.allocate(64)
    prompt, cont = random_prompt(12, seed=1), random_prompt(17, seed=2)
    runner.forward(seq, prompt, 0, 1)
    single = np.stack([runner.forward(seq, [t], 12 + i, 1)[0] for i, t in enumerate(cont)])
    equal = []
    for width in range(2, 18):
        runner.truncate(seq, 12)
        equal.append(np.array_equal(runner.forward(seq, cont[:width], 12, width), single[:width]))
    if runner.precision.batch_invariant:
        assert all(equal), f"widths differing: {[w for w, e in zip(range(2, 18), equal) if not e]}"
    else:
        assert not all(equal), "policy says not batch-invariant but every width matched: update it"


def _spy_windows(runner) -> list[int]:
    """The attention window of every call (the one-sequence graph's `window`
    input; the batched graph's is the key index's last axis)."""
    windows = []
    if hasattr(runner, "_session") and "kv_index" in {i.name for i in runner._session.get_inputs()}:
        infer = runner._infer_batch
        runner._infer_batch = lambda feeds: windows.append(feeds["kv_index"].shape[2]) or infer(feeds)
    else:
        infer = runner._infer
        runner._infer = lambda feeds, past: windows.append(int(feeds["window"])) or infer(feeds, past)
    return windows


@pytest.mark.parametrize("backend,precision", [("onnxruntime:pool", "fp32"), ("onnxruntime:pool", "int4"),
                                               ("openvino", "fp32"), ("openvino", "int4")])
def test_attention_window_length_never_changes_a_row(tiny_model_dir, backend, precision):
    """Attention reads a window of whole blocks, so a verify and the one-token
    steps it replaces often read windows of different lengths: the masked
    tail must add exact zeros, bitwise, on every path. (onnxruntime's SlabAttention
    reads no window: its rows are checked by the invariance test above.)"""
    runner = _load(backend, tiny_model_dir("llama"), precision)
    runner.WINDOW_BLOCK = 16  # several windows within a short test
    windows = _spy_windows(runner)
    seq = runner.allocate(60)  # reserved as 64: whole blocks
    prompt, cont = random_prompt(10, seed=5), random_prompt(45, seed=6)
    runner.forward(seq, prompt, 0, 1)
    single = np.stack([runner.forward(seq, [t], 10 + i, 1)[0] for i, t in enumerate(cont)])
    for start in range(0, 40, 3):
        for width in (2, 3, 5, 8, 13):
            if start + width > len(cont):
                continue
            runner.truncate(seq, 10 + start)
            rows = runner.forward(seq, cont[start:start + width], 10 + start, width)
            assert np.array_equal(rows, single[start:start + width]), (start, width)
    assert sorted(set(windows)) == [16, 32, 48, 64]


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_a_slab_the_budget_cannot_round_is_read_whole(tiny_model_dir, backend):
    """OpenVINO rounds a row alike only over whole blocks, so a slab that is not
    whole blocks is read whole; onnxruntime's rows are window-invariant, so its
    window stays block-rounded (slots past the slab are masked) and is never
    longer than the slab."""
    model = load_model_ir(tiny_model_dir("llama"))
    budget = 40 * model.config.kv_bytes_per_token(4)
    runner = load_pool_graph(REGISTRY.get(backend), model, "cpu", "fp32", budget) if backend == "onnxruntime" \
        else REGISTRY.get(backend).load(model, "cpu", "fp32", budget)  # (onnxruntime: the graph that reads windows)
    windows = _spy_windows(runner)
    seq = runner.allocate(40)  # 64 does not fit: the exact 40
    runner.forward(seq, random_prompt(5, seed=1), 0, 1)
    runner.forward(seq, [3], 5, 1)
    runner.forward(seq, list(range(33)), 6, 33)
    assert windows == ([40, 40, 40] if backend == "openvino" else [32, 32, 40])


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_one_token_at_the_last_slot_of_a_slab(tiny_model_dir, backend):
    """Quantised one-token calls run as two rows; at a slab's last slot there is
    no room for the discarded row, so that call runs alone (never a write
    past the slab) and still scores like the same token in a wider slab."""
    runner = _load(backend, tiny_model_dir("llama"), "int8")
    prompt = random_prompt(32, seed=4)
    tight, roomy = runner.allocate(32), runner.allocate(64)  # whole window blocks: no rounding up
    for seq in (tight, roomy):
        runner.forward(seq, prompt[:31], 0, 1)
    last = runner.forward(tight, prompt[31:], 31, 1)
    wide = runner.forward(roomy, prompt[31:], 31, 1)
    assert runner.length(tight) == 32
    np.testing.assert_allclose(last, wide, atol=0.2)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_rollback_moves_no_kv_data_and_rewrites_correctly(tiny_model_dir, backend):
    runner = _load(backend, tiny_model_dir("llama"))
    seq = runner.allocate(64)
    a, b = random_prompt(20, seed=6), random_prompt(8, seed=7)
    runner.forward(seq, a, 0, 1)
    runner.forward(seq, random_prompt(8, seed=8), 20, 8)  # drafts that get rejected
    (pool,) = runner.kv_buffers()
    before, ptr = pool.copy(), pool.ctypes.data
    runner.truncate(seq, 20)
    assert pool.ctypes.data == ptr and np.array_equal(pool, before)
    after = runner.forward(seq, b, 20, 8)
    fresh = runner.allocate(64)
    runner.forward(fresh, a, 0, 1)
    assert np.array_equal(after, runner.forward(fresh, b, 20, 8))


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_budget_and_errors(tiny_model_dir, backend):
    model = load_model_ir(tiny_model_dir("llama"))
    per_token = model.config.kv_bytes_per_token(4)
    runner = REGISTRY.get(backend).load(model, "cpu", "fp32", 50 * per_token)
    runner.allocate(40)
    with pytest.raises(KVBudgetError, match="KV budget exhausted"):
        runner.allocate(20)
    with pytest.raises(BackendError, match="no device 'tpu'.*available"):
        REGISTRY.get(backend).load(model, "tpu", "fp32", 1 << 20)
    with pytest.raises(BackendError, match="precision 'int3'.*supported: fp32"):
        REGISTRY.get(backend).load(model, "cpu", "int3", 1 << 20)


def test_onnx_export_is_cached_and_rebuilt_when_stale(tiny_model_dir, tmp_path, monkeypatch):
    import shutil

    from hetero_sd.backends import ort_backend

    monkeypatch.setenv("HETERO_SD_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), folder)
    builds = []
    real = ort_backend.build_llama_onnx
    monkeypatch.setattr(ort_backend, "build_llama_onnx", lambda *a, **k: builds.append(1) or real(*a, **k))
    model = load_model_ir(folder)
    first = ort_backend.export_onnx(model, "fp32")
    assert ort_backend.export_onnx(load_model_ir(folder), "fp32") == first and len(builds) == 1
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes())  # same content, new mtime: the key changes
    import os
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert ort_backend.export_onnx(load_model_ir(folder), "fp32") != first and len(builds) == 2


def test_smollm2_parity_graph_backends(smollm2_gguf):
    model = load_model_ir(smollm2_gguf)
    tok = model.load_tokenizer()
    ids = tok("The capital of France is")["input_ids"]
    ref = reference_logits(model, ids).numpy()
    for backend in GRAPH_BACKENDS:
        runner = REGISTRY.get(backend).load(model, "cpu", "fp32", 16 << 20)
        got = runner.forward(runner.allocate(16), ids, 0, len(ids))
        assert np.abs(got - ref).max() < 1e-3, backend  # 30 layers of fp32 reassociation
        assert tok.decode(int(got[-1].argmax())).strip() == "Paris"


@pytest.mark.parametrize("backend,precision", [("onnxruntime", "int4"), ("openvino", "int4"),
                                               ("openvino", "fp32")])
def test_smollm2_batch_invariance(smollm2_gguf, backend, precision):
    """On the real model's shapes too (kernel paths depend on them), verify rows equal one-token steps."""
    model = load_model_ir(smollm2_gguf)
    runner = REGISTRY.get(backend).load(model, "cpu", precision, 16 << 20)
    runner.WINDOW_BLOCK = 16  # single steps and verifies then read windows of different lengths
    text = "Copy exactly: the motor stops after sixty seconds to avoid overheating, then cools for ten minutes."
    ids = model.load_tokenizer()(text)["input_ids"]
    assert len(ids) >= 19
    seq = runner.allocate(64)
    runner.forward(seq, ids[:8], 0, 1)
    single = np.stack([runner.forward(seq, [t], 8 + i, 1)[0] for i, t in enumerate(ids[8:19])])
    for width in (2, 5, 8, 11):  # ends 10..19: windows of 16 and 32 slots
        runner.truncate(seq, 8)
        assert np.array_equal(runner.forward(seq, ids[8:8 + width], 8, width), single[:width]), width


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_failed_runtime_call_leaves_sequence_length(tiny_model_dir, backend, monkeypatch):
    runner = _load(backend, tiny_model_dir("llama"))
    seq = runner.allocate(32)
    runner.forward(seq, random_prompt(5, seed=1), 0, 1)

    def boom(*feeds):
        raise RuntimeError("device fell over")

    monkeypatch.setattr(runner, "_infer", boom)
    monkeypatch.setattr(runner, "_infer_batch", boom)
    if backend == "onnxruntime":  # its SlabAttention graph's call
        monkeypatch.setattr(runner._varlen, "run", boom)
    with pytest.raises(RuntimeError, match="fell over"):
        runner.forward(seq, [1, 2, 3], 5, 3)
    assert runner.length(seq) == 5  # nothing claimed that was not written
