"""SlabAttention (backends/native): our attention op, compiled here, against a
float64 reference; a row rounds alike alone and inside any call; the graph that
uses it, end to end (its one-token decode equals every verify row: test_row_check)."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from hetero_sd.backends import native
from hetero_sd.backends.onnx_native import DOMAIN
from hetero_sd.backends.registry import discover
from hetero_sd.ir import load_model_ir, reference_logits
from helpers.native import needs_avx2
from helpers.tiny_models import random_prompt

REGISTRY = discover()


@pytest.fixture
def library(monkeypatch):
    monkeypatch.setenv(native.ENV, "1")
    return native.attention_library()  # on such a CPU, a build failure fails the test


def _session(lib, H, Hkv, D, rotary):
    import onnxruntime as ort

    v = helper.make_tensor_value_info
    slab = lambda n: v(n, TensorProto.FLOAT, [1, Hkv, "R", D])  # noqa: E731
    node = helper.make_node("SlabAttention", ["qkv", "pk", "pv", "total", "cos", "sin"], ["o", "k", "v"],
                            domain=DOMAIN, num_heads=H, kv_num_heads=Hkv, rotary=rotary, scale=0.3)
    graph = helper.make_graph([node], "g", [v("qkv", TensorProto.FLOAT, ["T", (H + 2 * Hkv) * D]), slab("pk"),
                                            slab("pv"), v("total", TensorProto.INT32, []),
                                            v("cos", TensorProto.FLOAT, ["P", "W"]), v("sin", TensorProto.FLOAT, ["P", "W"])],
                              [v("o", TensorProto.FLOAT, ["T", H * D]), slab("k"), slab("v")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    opts.register_custom_ops_library(str(lib))
    return ort.InferenceSession(model.SerializeToString(), opts)


def _reference(qkv, K, V, past, H, Hkv, D, cos, sin, rotary):
    """Causal attention in float64, rotate-half RoPE over the tables' width."""
    T, half = qkv.shape[0], cos.shape[1]
    x = qkv.astype(np.float64).reshape(T, H + 2 * Hkv, D)
    K, V = K[0].astype(np.float64).copy(), V[0].astype(np.float64).copy()

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
        for h in range(H):
            g = h // (H // Hkv)
            s = K[g, :n] @ rope(x[t, h], past + t) * 0.3
            p = np.exp(s - s.max())
            out[t, h] = p @ V[g, :n] / p.sum()
    return out.reshape(T, H * D), K, V


@needs_avx2
@pytest.mark.parametrize("H,Hkv,D,half", [(4, 4, 16, 8), (4, 2, 32, 16), (12, 2, 64, 32), (6, 1, 16, 4)])
@pytest.mark.parametrize("rotary", [1, 0])
def test_the_op_matches_a_float64_reference(library, H, Hkv, D, half, rotary):
    rng = np.random.default_rng(H * D + rotary)
    cos, sin = (rng.random((64, half), dtype=np.float32) for _ in range(2))
    sess, R = _session(library, H, Hkv, D, rotary), 48
    for past, T in ((0, 1), (0, 9), (7, 1), (20, 5), (31, 17)):
        K, V = (rng.standard_normal((1, Hkv, R, D), dtype=np.float32) for _ in range(2))
        qkv = rng.standard_normal((T, (H + 2 * Hkv) * D), dtype=np.float32)
        out, k, v = sess.run(None, {"qkv": qkv, "pk": K, "pv": V, "total": np.array(past + T, np.int32),
                                    "cos": cos, "sin": sin})
        ref, rk, rv = _reference(qkv, K, V, past, H, Hkv, D, cos, sin, rotary)
        assert np.abs(out - ref).max() < 1e-5, (past, T)
        assert np.abs(k[0, :, :past + T] - rk[:, :past + T]).max() < 1e-5
        assert np.array_equal(v[0, :, :past + T], rv[:, :past + T].astype(np.float32))
        assert np.array_equal(k[0, :, :past], K[0, :, :past])  # the past carried over, untouched


@needs_avx2
@pytest.mark.parametrize("H,Hkv,D", [(12, 2, 64), (9, 3, 64)])  # 6 and 3 query heads a KV head (the 1.5B's, SmolLM2's)
def test_a_row_rounds_alike_alone_and_in_any_call(library, H, Hkv, D):
    """Row t of a T-row call equals the same row run alone after rows 0..t-1, bitwise."""
    rng = np.random.default_rng(5)
    sess, R, past = _session(library, H, Hkv, D, 1), 64, 21
    cos, sin = (rng.random((R, D // 2), dtype=np.float32) for _ in range(2))
    K, V = (rng.standard_normal((1, Hkv, R, D), dtype=np.float32) for _ in range(2))
    qkv = rng.standard_normal((16, (H + 2 * Hkv) * D), dtype=np.float32)
    feed = lambda q, k, v, total: {"qkv": q, "pk": k, "pv": v, "total": np.array(total, np.int32),  # noqa: E731
                                   "cos": cos, "sin": sin}
    alone, k, v = [], K, V
    for t in range(16):
        out, k, v = sess.run(None, feed(qkv[t:t + 1], k, v, past + t + 1))
        alone.append(out[0])
    for width in (1, 2, 3, 4, 5, 8, 9, 16):
        out, kw, _ = sess.run(None, feed(qkv[:width], K, V, past + width))
        assert np.array_equal(out, np.stack(alone[:width])), width
        assert np.array_equal(kw[0, :, :past + width], k[0, :, :past + width])


@needs_avx2
def test_it_is_on_by_default_and_off_where_not_named(monkeypatch):
    monkeypatch.delenv(native.ENV, raising=False)
    assert native.attention_available() == (True, "")
    monkeypatch.setenv(native.ENV, "matmul")
    assert native.attention_available() == (False, f"off ({native.ENV}=matmul,attention turns it on)")


def test_devices_say_which_attention_runs(monkeypatch):
    monkeypatch.setenv(native.ENV, "matmul")
    cpu = next(d for d in REGISTRY.get("onnxruntime").probe() if d.device == "cpu")
    assert cpu.description.endswith(f"attention: GroupQueryAttention; SlabAttention off ({native.ENV}=matmul,attention "
                                    "turns it on)")


@needs_avx2
def test_devices_say_when_our_attention_runs(library):
    cpu = next(d for d in REGISTRY.get("onnxruntime").probe() if d.device == "cpu")
    assert cpu.description.endswith("attention: our SlabAttention")


def test_models_it_does_not_cover_say_why(tiny_model_dir):
    assert native.native_fits(load_model_ir(tiny_model_dir("llama")).config) == (True, "")
    assert native.native_fits(load_model_ir(tiny_model_dir("mistral-swa")).config) == (False, "sliding-window layers")


@needs_avx2
@pytest.mark.parametrize("variant", ["llama-tied", "qwen2", "llama3-rope", "mistral-swa"])
@pytest.mark.parametrize("precision,tol", [("fp32", 1e-4), ("int8", 0.2), ("int4", 1.5)])  # test_graph_backends CASES
def test_the_graph_matches_the_reference(tiny_model_dir, monkeypatch, library, variant, precision, tol):
    """The in-place graph with SlabAttention (GroupQueryAttention where the model has
    what the op does not cover) against transformers' logits."""
    folder = tiny_model_dir(variant)
    ir = load_model_ir(folder)
    runner = REGISTRY.get("onnxruntime").load(ir, "cpu", precision, 1 << 20)
    covered = native.native_fits(ir.config)[0]
    assert ("our SlabAttention" in runner.kernel_choice) == covered, runner.kernel_choice
    prompt = random_prompt(30, seed=3)
    ref = reference_logits(ir, prompt).numpy()
    got = runner.forward(runner.allocate(40), prompt, 0, len(prompt))
    assert np.abs(got - ref).max() <= (tol if precision == "fp32" else tol * ref.std())
    seq = runner.allocate(40)  # and decoding token by token lands on the same logits
    runner.forward(seq, prompt[:20], 0, 1)
    steps = np.stack([runner.forward(seq, [t], 20 + i, 1)[0] for i, t in enumerate(prompt[20:])])
    assert np.abs(steps - ref[20:]).max() <= (tol if precision == "fp32" else tol * ref.std())
