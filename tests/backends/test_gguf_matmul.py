"""GGUFMatMul (backends/native/gguf_matmul.c): a matmul on a GGUF file's own blocks
(Q4_K / Q6_K super-blocks; Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 blocks of 32), against a float64
reference of its numerics (int8 activations per 256 values, per 32 for the 32-value
types, exact integer sums); a row rounds alike alone and inside any call; its two
builds (AVX-512 VNNI's 16-bit dot product, AVX2's) agree bit for bit; the precision
`gguf` graph puts it on every such linear layer (tests/backends/test_native_matmul.py
covers BlockMatMul, the same graphs' other op)."""
from __future__ import annotations

import gguf
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from hetero_sd.backends import gguf_pack, native
from hetero_sd.backends.options import BackendOptions
from hetero_sd.backends.registry import discover
from hetero_sd.ir import load_model_ir, quant
from helpers.gguf_mixes import encode
from helpers.native import assert_rows_alike, matmul_library, needs_avx2, x86_avx512  # noqa: F401 (the fixture `library`)
from helpers.tiny_models import random_prompt

REGISTRY = discover()


KQUANTS = ("Q4_K", "Q6_K")
BLOCKS32 = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
# where each type keeps its fp16 fields (d, and a minimum's): random bytes there stay finite
HALVES = {"Q4_K": (0, 2), "Q6_K": (208,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,)}


def _raw(rng, kind, n, k, noise=False):
    """[n, k / block * bytes] blocks: encoded from gaussian weights, or (noise) random
    bytes with every scale field finite (extreme codes, negative Q6_K scales and
    Q4_1 / Q5_1 minimums of either sign)."""
    if not noise:
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        w[:, :7] += 0.1  # blocks off centre: a minimum of their own
        return encode(kind, w)
    per, size = quant.SUPPORTED[kind]
    raw = rng.integers(0, 256, (n * k // per, size), dtype=np.uint8)
    for at in HALVES[kind]:
        scale = 0.001 if kind == "Q6_K" else 0.01
        raw[:, at:at + 2] = ((rng.random(len(raw)) - (at > 0) * 0.5) * scale).astype(np.float16).view(np.uint8) \
            .reshape(-1, 2)
    return raw.reshape(n, -1)


def _session(lib, kind, k, n, raw, threads=2, packed=None, bias=None, up=None, type_id=None, pairs=None):
    """The op over the file's bytes `raw` (packed as the lowering packs them for `lib`),
    or over `packed` as given; with `bias`, or gated with `up` (then `raw` is the gate);
    type_id: the op's type attribute, where not kind's; pairs: its pairs attribute,
    where not the library's."""
    import onnxruntime as ort

    built = native.pairs_of(lib)
    if packed is None:
        packed = gguf_pack.pack(kind, raw, pairs=built) if up is None else \
            gguf_pack.pack_gated(kind, raw, up, pairs=built)
    attrs = {"pairs": int(built if pairs is None else pairs)}
    inits = [numpy_helper.from_array(packed, "B")]
    if bias is not None:
        inits.append(numpy_helper.from_array(bias, "bias"))
    node = helper.make_node("GGUFMatMul", ["A", "B"] + (["bias"] if bias is not None else []), ["Y"],
                            domain=native.DOMAIN, K=k, N=n, type=type_id or native.GGUF_TYPES[kind],
                            **({"gated": 1} if up is not None else {}), **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", "K"])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(native.DOMAIN, 1)])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.register_custom_ops_library(str(lib))
    return ort.InferenceSession(model.SerializeToString(), opts)


def _reference(a, w, kind="Q4_K"):
    """The op's numerics in float64: each row quantized to int8 per 256 values (per 32
    for the 32-value types; scale amax / 127 and its float32 inverse, round half to
    even), against the file's weights (gguf's own dequantization: exact in float32)."""
    m, k = a.shape
    block = 256 if kind in KQUANTS else 32
    x = a.reshape(m, k // block, block)
    d = np.abs(x).max(-1) / np.float32(127)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.rint((x * inv[..., None]).astype(np.float32)).astype(np.float64)
    return (q * d[..., None].astype(np.float64)).reshape(m, k) @ w.astype(np.float64).T


CASES = [("Q4_K", 256, 37, False), ("Q4_K", 1536, 33, True), ("Q4_K", 768, 64, False),
         ("Q6_K", 256, 41, True), ("Q6_K", 1280, 35, False), ("Q6_K", 512, 3, False),
         ("Q4_0", 64, 9, True), ("Q4_0", 896, 24, False), ("Q4_1", 896, 37, False), ("Q4_1", 192, 8, True),
         ("Q5_0", 896, 33, True), ("Q5_0", 320, 16, False), ("Q5_1", 320, 21, True), ("Q5_1", 576, 40, False),
         ("Q8_0", 896, 41, True), ("Q8_0", 192, 5, False)]


@needs_avx2
@pytest.mark.parametrize("kind,k,n,noise", CASES)
def test_the_op_matches_a_float64_reference(library, kind, k, n, noise):
    rng = np.random.default_rng(k + n)
    raw = _raw(rng, kind, n, k, noise)
    w = quant.dequantize(quant.decode(kind, raw, n, k))
    sess = _session(library, kind, k, n, raw)
    for m in (1, 3, 4, 5, 9, 70):  # every tile height; 70 rows cross a task's 64
        a = rng.standard_normal((m, k)).astype(np.float32)
        a[:, 5] *= 40  # an outlier, as hidden states have
        a[:, 300 % k:] += 0.5  # sub-blocks whose sums are far from zero: minimums and Q6_K's offset count
        got = sess.run(None, {"A": a})[0]
        ref = _reference(a, w, kind)
        assert got.shape == (m, n)
        assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max(), (m, np.abs(got - ref).max())
        assert np.abs(got - a @ w.T).max() <= 0.15 * np.abs(ref).max()  # int8 activations (an outlier): near the float product


def _silu(x):
    return x * 0.5 * (1 + np.tanh(x / 2))  # (x sigmoid(x), with no overflow)


@needs_avx2
@pytest.mark.parametrize("kind,k,n", [("Q4_K", 512, 29), ("Q6_K", 768, 16), ("Q5_0", 896, 21), ("Q4_1", 128, 16),
                                      ("Q8_0", 192, 11)])
def test_the_bias_and_the_gated_form_match_the_reference(library, kind, k, n):
    """With a bias, Y = A W^T + bias; gated, silu(A G^T) * (A U^T) (an MLP's gate, up and
    activation in one op), against the float64 reference, large activations included
    (silu's exponential clamps, never overflows)."""
    rng = np.random.default_rng(k * n)
    raw, up = _raw(rng, kind, n, k), _raw(rng, kind, n, k, noise=True)
    w, wu = (quant.dequantize(quant.decode(kind, r, n, k)) for r in (raw, up))
    bias = rng.standard_normal(n).astype(np.float32)
    biased, gated = _session(library, kind, k, n, raw, bias=bias), _session(library, kind, k, n, raw, up=up)
    for m in (1, 5, 9):
        a = rng.standard_normal((m, k)).astype(np.float32)
        ref = _reference(a, w, kind)
        got = biased.run(None, {"A": a})[0]
        assert np.abs(got - (ref + bias)).max() <= 1e-5 * np.abs(ref + bias).max()
        for scale in (1, 400):  # (400: gate values past exp's range)
            ref_g, ref_u = _reference(a * scale, w, kind), _reference(a * scale, wu, kind)
            want = _silu(ref_g) * ref_u
            got = gated.run(None, {"A": a * scale})[0]
            assert np.isfinite(got).all() and got.shape == (m, n)
            assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), (m, scale)


@needs_avx2
@pytest.mark.parametrize("kind", KQUANTS + BLOCKS32)
def test_a_row_rounds_alike_alone_and_in_any_call(library, kind):
    """Bitwise: rows of one 16-row call against the same rows in calls of 1..16 rows at
    every offset, a 70-row call (a prefill: two row tasks) against its rows alone, and
    one thread against two."""
    rng = np.random.default_rng(7)
    k, n = 768, 45
    raw = _raw(rng, kind, n, k)
    sess = _session(library, kind, k, n, raw)
    a = rng.standard_normal((70, k)).astype(np.float32)
    whole = assert_rows_alike(lambda x: sess.run(None, {"A": x})[0], a)
    assert np.array_equal(_session(library, kind, k, n, raw, threads=1).run(None, {"A": a})[0], whole)
    up, bias = _raw(rng, kind, n, k), rng.standard_normal(n).astype(np.float32)
    for extra in ({"up": up}, {"bias": bias}):  # the gated form, the bias
        sess = _session(library, kind, k, n, raw, **extra)
        assert_rows_alike(lambda x: sess.run(None, {"A": x})[0], a)


@needs_avx2
def test_the_two_builds_agree_bit_for_bit():
    """VNNI's 16-bit dot product and AVX2's multiply-add compute the same exact integers,
    and both builds run the same float operations: one result."""
    if not x86_avx512():
        pytest.skip("one build only on an AVX2 host")
    rng = np.random.default_rng(3)
    a = rng.standard_normal((5, 512)).astype(np.float32)
    for kind in KQUANTS + BLOCKS32:
        raw, up = _raw(rng, kind, 29, 512, noise=True), _raw(rng, kind, 29, 512, noise=True)
        outs = []
        for flags in ("", "-mno-avx512f"):
            lib = native.library("matmul", BackendOptions(native=("matmul",), native_cflags=flags))
            outs.append([_session(lib, kind, 512, 29, raw).run(None, {"A": a})[0],
                         _session(lib, kind, 512, 29, raw, up=up).run(None, {"A": a})[0]])  # (gated: its exp too)
        assert all(np.array_equal(x, y) for x, y in zip(*outs)), kind


@needs_avx2
def test_bad_shapes_and_types_are_clear_errors(library):
    rng = np.random.default_rng(0)
    raw = _raw(rng, "Q4_K", 8, 256)
    with pytest.raises(Exception, match=r"GGUFMatMul: A \[\.\.\., K\]"):
        _session(library, "Q4_K", 256, 8, raw).run(None, {"A": np.zeros((2, 128), np.float32)})
    packed = gguf_pack.pack("Q4_K", raw, pairs=native.pairs_of(library))
    with pytest.raises(Exception, match=r"GGUFMatMul: A \[\.\.\., K\], B \[ceil\(N / 8\)"):  # Q6_K's groups are longer
        _session(library, "Q6_K", 256, 8, raw, packed=packed).run(None, {"A": np.zeros((2, 256), np.float32)})
    with pytest.raises(Exception, match=r"GGUFMatMul: A \[\.\.\., K\], B \[ceil\(N / 8\), K / \(256 or 64\)"):
        _session(library, "Q8_0", 256, 8, raw, packed=packed).run(None, {"A": np.zeros((2, 256), np.float32)})
    with pytest.raises(Exception, match=r"GGUFMatMul: type 12 \(Q4_K\) or 14 \(Q6_K\) with K a multiple of 256, or 2, 3"):
        _session(library, "Q4_K", 256, 8, raw, packed=packed, type_id=13)  # Q5_K: not a type it reads
    with pytest.raises(Exception, match=r"Q5_0, Q5_1, Q8_0\) with K a multiple of 64"):
        _session(library, "Q8_0", 96, 8, raw, packed=np.zeros((1, 1, 544), np.uint8))
    with pytest.raises(Exception, match=r"GGUFMatMul: A \[\.\.\., K\], B \[2 ceil\(N / 8\).*\(gated\)"):  # one half only
        _session(library, "Q4_K", 256, 8, raw, packed=packed, up=raw).run(None, {"A": np.zeros((2, 256), np.float32)})
    other = "AVX2 build \\(pairs 0\\); this build is AVX-512's" if native.pairs_of(library) else \
        "AVX-512 build \\(pairs 1\\); this build is AVX2's"
    for kind in ("Q6_K", "Q5_0"):
        with pytest.raises(Exception, match=f"GGUFMatMul: weights packed for the {other} .*: lower the graph"):
            _session(library, kind, 256, 8, _raw(rng, kind, 8, 256), pairs=not native.pairs_of(library))
    with pytest.raises(Exception, match=r"GGUFMatMul: bias \[N\]"):
        _session(library, "Q4_K", 256, 8, raw, bias=np.zeros(7, np.float32)).run(None, {"A": np.zeros((2, 256), np.float32)})
    with pytest.raises(ValueError, match="GGUFMatMul holds Q4_K, Q6_K, Q4_0, .*, not Q5_K"):
        gguf_pack.pack("Q5_K", raw, pairs=True)
    with pytest.raises(ValueError, match="Q8_0: a row of 96 values is not a multiple of 64"):
        gguf_pack.pack("Q8_0", _raw(rng, "Q8_0", 8, 96), pairs=True)
    with pytest.raises(ValueError, match="gate and up differ in shape"):
        gguf_pack.pack_gated("Q4_K", raw, _raw(rng, "Q4_K", 8, 512), pairs=True)


def test_the_two_step_pair_layouts_hold_the_same_bytes():
    """AVX-512's layout (a column's two steps together) and AVX2's (a step's 8 columns,
    then the next's) differ only in the order of 4-byte words within each step pair,
    for every type."""
    rng = np.random.default_rng(4)
    for kind, at in (("Q4_K", 160), ("Q6_K", 0)):
        raw = _raw(rng, kind, 16, 512, noise=True)
        wide, narrow = gguf_pack.pack(kind, raw, pairs=True), gguf_pack.pack(kind, raw, pairs=False)
        assert wide.shape == narrow.shape and not np.array_equal(wide, narrow)
        span = slice(at, at + 1536 if kind == "Q6_K" else at + 1024)
        assert np.array_equal(wide[..., :span.start], narrow[..., :span.start])
        assert np.array_equal(wide[..., span.stop:], narrow[..., span.stop:])
        words = lambda x: x[..., span].reshape(*x.shape[:2], -1, 2, 8, 4)  # noqa: E731 [pair][2 steps][8 columns][4]
        assert np.array_equal(words(narrow), words(wide).reshape(*wide.shape[:2], -1, 8, 2, 4).swapaxes(-3, -2))
    for kind in BLOCKS32:  # qs (its last 256 or 512 bytes) in pairs alike
        raw = _raw(rng, kind, 16, 512, noise=True)
        wide, narrow = gguf_pack.pack(kind, raw, pairs=True), gguf_pack.pack(kind, raw, pairs=False)
        qs = 512 if kind == "Q8_0" else 256
        assert np.array_equal(wide[..., :-qs], narrow[..., :-qs]) and not np.array_equal(wide, narrow)
        words = lambda x: x[..., -qs:].reshape(*x.shape[:2], -1, 2, 8, 4)  # noqa: E731
        assert np.array_equal(words(narrow), words(wide).reshape(*wide.shape[:2], -1, 8, 2, 4).swapaxes(-3, -2))


def test_types_it_covers():
    assert native.gguf_fits("Q4_K", 1536) and native.gguf_fits("Q6_K", 8960)
    assert not native.gguf_fits("Q4_K", 128) and not native.gguf_fits("Q5_K", 256)
    assert all(native.gguf_fits(kind, 896) for kind in BLOCKS32)  # blocks of 32, in pairs
    assert not native.gguf_fits("Q8_0", 96) and not native.gguf_fits(None, 256)


@needs_avx2
@pytest.mark.parametrize("mix", ["Q4_K_M", "LEGACY"])
def test_the_gguf_graph_runs_the_files_blocks(tiny_gguf, mix):
    """precision gguf with our matmuls on: over a Q4_K_M file every Q4_K / Q6_K layer, over
    a file of every 32-value type (Q4_0 .. Q8_0, one per tensor) every layer, is a
    GGUFMatMul on the file's bytes (no BlockMatMul, MatMulNBits or side matmul for
    minimums); the logits are the file's model's, up to int8 activations; a one-token
    decode equals the same rows of a verify."""
    path = tiny_gguf("qwen2-wide", mix)
    ir = load_model_ir(path)
    ours = REGISTRY.get("onnxruntime").load(ir, "cpu", "gguf", 1 << 20,
                                            options=BackendOptions(native=("matmul",), native_matmul="always"))
    assert "by our BlockMatMul" in ours.kernel_choice and ours.padding == "none"
    graph = onnx.load(str(ours._graph_path("pool", True)), load_external_data=False).graph
    ops = [n for n in graph.node if n.op_type == "GGUFMatMul"]
    types = {a.i for n in ops for a in n.attribute if a.name == "type"}
    kinds = {v: kind for kind, v in native.GGUF_TYPES.items()}
    if mix == "Q4_K_M":
        assert {12, 14} <= types <= {12, 14, 8}  # (Q8_0 where a row is not a multiple of 256)
    else:
        assert len(types) >= 3 and types <= {native.GGUF_TYPES[kind] for kind in BLOCKS32}
    assert not any(n.op_type in ("BlockMatMul", "MatMulNBits", "ReduceSum") for n in graph.node)
    inits = {t.name: t for t in graph.initializer}
    for node in ops:  # the file's blocks, 8 columns a group (gguf_pack.py); gated: two
        attrs = {a.name: a.i for a in node.attribute}
        kind = kinds[attrs["type"]]
        groups = (1 + attrs.get("gated", 0)) * -(-attrs["N"] // 8)
        assert list(inits[node.input[1]].dims) == [groups, attrs["K"] // gguf_pack.UNIT[kind], gguf_pack.BYTES[kind]]
    # an MLP whose gate and up share a type is one gated op (no split or activation nodes);
    # q/k/v's bias added by the ops (no Add reads an initializer)
    layers = ir.config.num_layers
    stored = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    alike = sum(stored[f"blk.{i}.ffn_gate.weight"] == stored[f"blk.{i}.ffn_up.weight"] for i in range(layers))
    assert sum(any(a.name == "gated" and a.i for a in n.attribute) for n in ops) == alike
    assert alike == layers or mix == "LEGACY"
    assert ir.config.attention_bias and sum(len(n.input) == 3 for n in ops) >= layers
    assert not [n.name for n in graph.node if n.op_type == "Add" and any(i in inits and len(inits[i].dims) for i in n.input)]
    prompt = random_prompt(20, seed=3)
    exact = REGISTRY.get("onnxruntime").load(ir, "cpu", "fp32", 1 << 20)  # the file's weights in float
    ref = exact.forward(exact.allocate(32), prompt, 0, len(prompt))
    got = ours.forward(ours.allocate(32), prompt, 0, len(prompt))
    assert np.abs(got - ref).max() < 0.2 * ref.std()  # test_gguf_precision's bound for int8 activations
    seq = ours.allocate(32)
    ours.forward(seq, prompt[:8], 0, 1)
    one = np.stack([ours.forward(seq, [t], 8 + i, 1)[0] for i, t in enumerate(prompt[8:])])
    ours.truncate(seq, 8)
    assert np.array_equal(ours.forward(seq, prompt[8:], 8, len(prompt) - 8), one)
