"""SlabAttention (backends/native): our attention op, compiled here, against a
float64 reference; a row rounds alike alone and inside any call; the graph that
uses it, end to end (its one-token decode equals every verify row: test_row_check)."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from hetero_sd.backends import native
from hetero_sd.backends.options import BackendOptions
from hetero_sd.backends.onnx_native import DOMAIN
from hetero_sd.backends.registry import discover
from hetero_sd.ir import load_model_ir, reference_logits
from helpers.native import needs_avx2
from helpers.tiny_models import random_prompt

REGISTRY = discover()


@pytest.fixture
def library():
    return native.library("attention")  # (on by default) on such a CPU, a build failure fails the test


LAYERS = 2  # slabs [2, LAYERS, Hkv, R, D] in the pool; the op runs layer 1's


def _session(lib, H, Hkv, D, rotary, window=0, cap=0.0):
    import onnxruntime as ort

    v = helper.make_tensor_value_info
    node = helper.make_node("SlabAttention", ["qkv", "pool", "seqs", "cos", "sin"], ["o"], domain=DOMAIN,
                            num_heads=H, kv_num_heads=Hkv, head_dim=D, layer=1, num_layers=LAYERS, rotary=rotary,
                            scale=0.3, window=window, softcap=cap)
    graph = helper.make_graph([node], "g", [v("qkv", TensorProto.FLOAT, ["T", (H + 2 * Hkv) * D]),
                                            v("pool", TensorProto.FLOAT, ["N"]), v("seqs", TensorProto.INT64, ["B", 5]),
                                            v("cos", TensorProto.FLOAT, ["P", "W"]), v("sin", TensorProto.FLOAT, ["P", "W"])],
                              [v("o", TensorProto.FLOAT, ["T", H * D])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    opts.register_custom_ops_library(str(lib))
    sess = ort.InferenceSession(model.SerializeToString(), opts)

    def run(qkv, pool, seqs, cos, sin):
        """seqs: (first row, rows, past, R, offset) per sequence; the pool is written in place."""
        io = sess.io_binding()
        io.bind_input("pool", "cpu", 0, np.float32, [pool.size], pool.ctypes.data)
        for name, x in (("qkv", qkv), ("seqs", np.asarray(seqs, np.int64)), ("cos", cos), ("sin", sin)):
            io.bind_cpu_input(name, x)
        io.bind_output("o", "cpu")
        sess.run_with_iobinding(io)
        return io.copy_outputs_to_cpu()[0]
    return run


def _slab(pool, offset, Hkv, R, D, kv):
    """Layer 1's K (kv 0) or V (kv 1) of the slab at `offset`: a view [Hkv, R, D]."""
    return pool[offset:offset + 2 * LAYERS * Hkv * R * D].reshape(2, LAYERS, Hkv, R, D)[kv, 1]


def _reference(qkv, K, V, past, H, Hkv, D, cos, sin, rotary, window=0, cap=0.0):
    """Causal attention in float64, rotate-half RoPE over the tables' width."""
    T, half = qkv.shape[0], cos.shape[1]
    x = qkv.astype(np.float64).reshape(T, H + 2 * Hkv, D)
    K, V = K.astype(np.float64).copy(), V.astype(np.float64).copy()

    def rope(y, pos):
        if not rotary:
            return y
        y, a, b = y.copy(), y[:half].copy(), y[half:2 * half].copy()
        y[:half], y[half:2 * half] = a * cos[pos] - b * sin[pos], b * cos[pos] + a * sin[pos]
        return y

    for t in range(T):
        for g in range(Hkv):
            K[g, past + t], V[g, past + t] = rope(x[t, H + g], past + t), x[t, H + Hkv + g]
    out = np.zeros((T, H, D))
    for t in range(T):
        n = past + t + 1
        lo = max(0, n - window) if window else 0
        for h in range(H):
            g = h // (H // Hkv)
            s = K[g, lo:n] @ rope(x[t, h], past + t) * 0.3
            if cap:
                s = cap * np.tanh(s / cap)
            p = np.exp(s - s.max())
            out[t, h] = p @ V[g, lo:n] / p.sum()
    return out.reshape(T, H * D), K, V


@needs_avx2
@pytest.mark.parametrize("H,Hkv,D,half", [(4, 4, 16, 8), (4, 2, 32, 16), (12, 2, 64, 32), (6, 1, 16, 4)])
@pytest.mark.parametrize("rotary,window,cap", [(1, 0, 0.0), (0, 0, 0.0), (1, 6, 0.0), (1, 0, 2.5)],
                         ids=["rope", "no-rope", "window", "softcap"])
def test_the_op_matches_a_float64_reference(library, H, Hkv, D, half, rotary, window, cap):
    rng = np.random.default_rng(H * D + rotary + window)
    cos, sin = (rng.random((64, half), dtype=np.float32) for _ in range(2))
    run, R, offset = _session(library, H, Hkv, D, rotary, window, cap), 48, 7  # the slab need not start at 0
    for past, T in ((0, 1), (0, 9), (7, 1), (20, 5), (31, 17)):
        pool = rng.standard_normal(offset + 2 * LAYERS * Hkv * R * D + 5, dtype=np.float32)
        before = pool.copy()
        K, V = (_slab(pool, offset, Hkv, R, D, kv).copy() for kv in (0, 1))
        qkv = rng.standard_normal((T, (H + 2 * Hkv) * D), dtype=np.float32)
        out = run(qkv, pool, [(0, T, past, R, offset)], cos, sin)
        ref, rk, rv = _reference(qkv, K, V, past, H, Hkv, D, cos, sin, rotary, window, cap)
        k, v = (_slab(pool, offset, Hkv, R, D, kv) for kv in (0, 1))
        assert np.abs(out - ref).max() < 1e-5, (past, T)
        assert np.abs(k[:, :past + T] - rk[:, :past + T]).max() < 1e-5
        assert np.array_equal(v[:, :past + T], rv[:, :past + T].astype(np.float32))
        written = np.zeros(pool.shape, bool)  # only the new rows' K and V were written
        for kv in (0, 1):
            _slab(written, offset, Hkv, R, D, kv)[:, past:past + T] = True
        assert np.array_equal(pool[~written], before[~written])


@needs_avx2
@pytest.mark.parametrize("H,Hkv,D", [(12, 2, 64), (9, 3, 64)])  # 6 and 3 query heads a KV head (the 1.5B's, SmolLM2's)
def test_a_row_rounds_alike_alone_in_any_call_and_in_any_batch(library, H, Hkv, D):
    """Row t of a T-row call equals the same row run alone after rows 0..t-1, bitwise,
    and so does every row of a call that packs several sequences (varlen) of other
    lengths and widths."""
    rng = np.random.default_rng(5)
    run, R, past = _session(library, H, Hkv, D, 1), 64, 21
    size = 2 * LAYERS * Hkv * R * D
    cos, sin = (rng.random((R, D // 2), dtype=np.float32) for _ in range(2))
    start = rng.standard_normal(size, dtype=np.float32)
    qkv = rng.standard_normal((16, (H + 2 * Hkv) * D), dtype=np.float32)
    pool, alone = start.copy(), []
    for t in range(16):
        alone.append(run(qkv[t:t + 1], pool, [(0, 1, past + t, R, 0)], cos, sin)[0])
    after = pool.copy()
    for width in (1, 2, 3, 4, 5, 8, 9, 16):
        pool = start.copy()
        assert np.array_equal(run(qkv[:width], pool, [(0, width, past, R, 0)], cos, sin), np.stack(alone[:width]))
        k = _slab(pool, 0, Hkv, R, D, 0)
        assert np.array_equal(k[:, :past + width], _slab(after, 0, Hkv, R, D, 0)[:, :past + width])
    # the same rows beside two other sequences, packed before and after them
    others = rng.standard_normal(2 * size, dtype=np.float32)
    o_qkv = rng.standard_normal((3 + 7, (H + 2 * Hkv) * D), dtype=np.float32)
    for width in (1, 5):
        pool = np.concatenate([others[:size], start, others[size:]])
        batch = np.concatenate([o_qkv[:3], qkv[:width], o_qkv[3:]])
        seqs = [(0, 3, 40, R, 0), (3, width, past, R, size), (3 + width, 7, 0, R, 2 * size)]
        out = run(batch, pool, seqs, cos, sin)
        assert np.array_equal(out[3:3 + width], np.stack(alone[:width])), width


@needs_avx2
@pytest.mark.parametrize("seqs,says", [
    ([(0, 2, 0, 8, 0), (1, 1, 0, 8, 4096)], "pack"),  # rows overlap
    ([(0, 3, 0, 8, 0)], "cover"),  # T = 4 rows, 3 covered
    ([(0, 4, 6, 8, 0)], "reserved"),  # past + rows > R
    ([(0, 2, 0, 8, 0), (2, 2, 0, 8, 100)], "overlap"),  # slabs overlap
    ([(0, 4, 0, 8, 1 << 20)], "outside the pool")])
def test_bad_extents_are_refused_before_a_write(library, seqs, says):
    run, D, Hkv = _session(library, 4, 2, 16, 1), 16, 2
    pool = np.zeros(3 * 2 * LAYERS * Hkv * 8 * D, np.float32)
    cos = np.ones((16, 8), np.float32)
    with pytest.raises(Exception, match=says):
        run(np.ones((4, 8 * D), np.float32), pool, seqs, cos, cos)
    assert not pool.any()


@needs_avx2
def test_it_is_on_by_default_and_off_where_not_named():
    assert native.kernel_available("attention") == (True, "")
    assert native.kernel_available("attention", BackendOptions(native=("matmul",))) == \
        (False, "off (native: matmul,attention turns it on)")


def test_devices_say_which_attention_runs():
    registry = discover(BackendOptions(native=("matmul",)))
    cpu = next(d for d in registry.get("onnxruntime").probe() if d.device == "cpu")
    assert cpu.description.endswith("attention: gathered from the pool; SlabAttention off (native: matmul,attention "
                                    "turns it on)")


@needs_avx2
def test_devices_say_when_our_attention_runs(library):
    cpu = next(d for d in REGISTRY.get("onnxruntime").probe() if d.device == "cpu")
    assert cpu.description.endswith("attention: our SlabAttention")


def test_models_it_does_not_cover_say_why(tiny_model_dir):
    from dataclasses import replace

    cfg = load_model_ir(tiny_model_dir("llama")).config
    assert native.native_fits(cfg) == (True, "")
    for variant in ("mistral-swa", "gemma3", "qwen3"):  # windows, soft-caps, q/k norms: covered
        assert native.native_fits(load_model_ir(tiny_model_dir(variant)).config) == (True, ""), variant
    assert native.native_fits(replace(cfg, head_dim=24)) == (False, "head dimension 24 (needs a multiple of 16, at most 512)")


@needs_avx2
@pytest.mark.parametrize("variant,precision,tol", [  # test_graph_backends CASES' tolerances
    *[(v, p, t) for v in ("llama-tied", "qwen2", "llama3-rope", "mistral-swa")
      for p, t in (("fp32", 1e-4), ("int8", 0.2), ("int4", 1.5))],
    # the other families' attention, where quantization cannot hide an error
    *[(v, "fp32", 1e-4) for v in ("gemma3", "qwen3", "phi3", "smollm3")]])
def test_the_graph_matches_the_reference(tiny_model_dir, monkeypatch, library, variant, precision, tol):
    """The graph with SlabAttention against transformers' logits, on every family's
    attention: windows, soft-caps, q/k norms, partial and local RoPE, NoPE layers."""
    folder = tiny_model_dir(variant)
    ir = load_model_ir(folder)
    runner = REGISTRY.get("onnxruntime").load(ir, "cpu", precision, 1 << 20)
    assert "our SlabAttention" in runner.kernel_choice, runner.kernel_choice
    prompt = random_prompt(30, seed=3)
    ref = reference_logits(ir, prompt).numpy()
    got = runner.forward(runner.allocate(40), prompt, 0, len(prompt))
    assert np.abs(got - ref).max() <= (tol if precision == "fp32" else tol * ref.std())
    seq = runner.allocate(40)  # and decoding token by token lands on the same logits
    runner.forward(seq, prompt[:20], 0, 1)
    steps = np.stack([runner.forward(seq, [t], 20 + i, 1)[0] for i, t in enumerate(prompt[20:])])
    assert np.abs(steps - ref[20:]).max() <= (tol if precision == "fp32" else tol * ref.std())
