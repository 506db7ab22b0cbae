"""BlockMatMul (backends/native/block_matmul.c): our block-quantized matmul, compiled
here, against a float64 reference of its own numerics (int8 activations per block,
exact integer dot products); a row rounds alike alone and inside any call, a prefill's
included; both of its instruction sets (AVX-512 VNNI and AVX2) where the host runs
them; the switch that picks our kernels; the graphs that use it (their one-token
decode equals every verify row: test_row_check)."""
from __future__ import annotations

import numpy as np
import pytest
import onnx
from onnx import TensorProto, helper, numpy_helper

from hetero_sd.backends import native
from hetero_sd.backends.options import KERNELS, BackendOptions, parse_native
from hetero_sd.backends.registry import discover
from hetero_sd.ir import load_model_ir, reference_logits
from hetero_sd.ir.errors import BackendError
from helpers.native import assert_rows_alike, matmul_library, needs_avx2, x86_avx512  # noqa: F401 (the fixture `library`)
from helpers.tiny_models import random_prompt

REGISTRY = discover()


def _weights(rng, k, n, bits, block, zero_points):
    kb = k // block
    packed = rng.integers(0, 256, (n, kb, block * bits // 8), dtype=np.uint8)
    scales = (rng.standard_normal((n, kb)) * 0.02).astype(np.float32)
    zp = rng.integers(0, 256, (n, -(-kb * bits // 8)), dtype=np.uint8) if zero_points else None
    return packed, scales, zp


def _session(lib, k, n, bits, block, packed, scales, zp, threads=2):
    import onnxruntime as ort

    inits = [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scales.reshape(-1), "S")]
    ins = ["A", "B", "S"]
    if zp is not None:
        inits.append(numpy_helper.from_array(zp, "Z"))
        ins.append("Z")
    node = helper.make_node("BlockMatMul", ins, ["Y"], domain=native.DOMAIN, K=k, N=n, bits=bits, block_size=block)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", "K"])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", "N"])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(native.DOMAIN, 1)])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.register_custom_ops_library(str(lib))
    return ort.InferenceSession(model.SerializeToString(), opts)


def _reference(a, packed, scales, zp, bits, block):
    """The op's numerics in float64: each row's blocks quantized to int8 as the op does
    (scale amax / 127 and its float32 inverse, round half to even), the integer dot
    products exact, the weights' zero points (8 or 128 where none is given)."""
    n, kb, _ = packed.shape
    if bits == 4:
        q = np.stack([packed & 15, packed >> 4], -1).reshape(n, kb, block).astype(np.int64)
        z = np.stack([zp & 15, zp >> 4], -1).reshape(n, -1)[:, :kb] if zp is not None else \
            np.full((n, kb), 8)
    else:
        q = packed.astype(np.int64)
        z = zp[:, :kb] if zp is not None else np.full((n, kb), 128)
    w = q - z.astype(np.int64)[..., None]  # [n, kb, block]
    blocks = a.reshape(a.shape[0], kb, block)
    d = np.abs(blocks).max(-1) / np.float32(127)  # float32, as the op
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    qa = np.rint(blocks * inv[..., None]).astype(np.int64)  # [m, kb, block]
    dots = np.einsum("mkb,nkb->mnk", qa, w)  # exact
    return np.einsum("mnk,mk,nk->mn", dots.astype(np.float64), d.astype(np.float64), scales.astype(np.float64))


CASES = [  # K, N, bits, block, zero points: tails of 64 (576, 320), N past a task's 32 columns
    (256, 37, 4, 32, False), (576, 19, 4, 32, True), (320, 23, 4, 64, True), (384, 33, 4, 128, True),
    (512, 21, 4, 256, True), (256, 41, 8, 32, False), (256, 39, 8, 64, True), (512, 17, 8, 128, False),
]


@needs_avx2
@pytest.mark.parametrize("k,n,bits,block,zp", CASES)
def test_the_op_matches_a_float64_reference(library, k, n, bits, block, zp):
    rng = np.random.default_rng(k + n)
    packed, scales, zps = _weights(rng, k, n, bits, block, zp)
    sess = _session(library, k, n, bits, block, packed, scales, zps)
    for m in (1, 3, 4, 5, 9, 70):  # every tile height; 70 rows cross a task's 64
        a = rng.standard_normal((m, k)).astype(np.float32)
        a[:, 5] *= 40  # an outlier, as hidden states have
        got = sess.run(None, {"A": a})[0]
        ref = _reference(a, packed, scales, zps, bits, block)
        assert got.shape == (m, n)
        assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max(), (m, np.abs(got - ref).max())


@needs_avx2
@pytest.mark.parametrize("k,n,bits,block,zp", [(576, 37, 4, 32, False), (384, 35, 4, 128, True), (256, 41, 8, 64, False)])
def test_a_row_rounds_alike_alone_and_in_any_call(library, k, n, bits, block, zp):
    """Bitwise: rows of one 16-row call against the same rows in calls of 1..16 rows at
    every offset, and a 70-row call (a prefill: two row tasks) against its rows alone."""
    rng = np.random.default_rng(7)
    packed, scales, zps = _weights(rng, k, n, bits, block, zp)
    sess = _session(library, k, n, bits, block, packed, scales, zps)
    assert_rows_alike(lambda x: sess.run(None, {"A": x})[0], rng.standard_normal((70, k)).astype(np.float32))


@needs_avx2
def test_the_two_builds_agree_up_to_their_float_sums():
    """The AVX-512 and AVX2 code sum the same exact integer dot products in other lane
    orders: equal up to float rounding (each is exact with itself, above)."""
    if not x86_avx512():
        pytest.skip("one build only on an AVX2 host")
    rng = np.random.default_rng(3)
    packed, scales, zps = _weights(rng, 576, 29, 4, 32, True)
    a = rng.standard_normal((5, 576)).astype(np.float32)
    outs = []
    for flags in ("", "-mno-avx512f"):
        lib = native.library("matmul", BackendOptions(native=("matmul",), native_cflags=flags))
        outs.append(_session(lib, 576, 29, 4, 32, packed, scales, zps).run(None, {"A": a})[0])
    assert np.abs(outs[0] - outs[1]).max() <= 1e-5 * np.abs(outs[0]).max()


@needs_avx2
def test_bad_shapes_and_attributes_are_clear_errors(library):
    rng = np.random.default_rng(0)
    packed, scales, _ = _weights(rng, 256, 8, 4, 32, False)
    sess = _session(library, 256, 8, 4, 32, packed, scales, None)
    with pytest.raises(Exception, match=r"BlockMatMul: A \[\.\.\., K\]"):
        sess.run(None, {"A": np.zeros((2, 128), np.float32)})
    with pytest.raises(Exception, match="BlockMatMul: bits 4 or 8, block_size 32/64/128/256"):
        _session(library, 256, 8, 4, 16, packed.reshape(8, 16, 8), scales.reshape(8, 8).repeat(2, 1), None)



def test_the_switch_names_our_kernels():
    """options.native (and $HETERO_SD_NATIVE, read when a config loads) names our kernels."""
    from hetero_sd.config import load_config
    from hetero_sd.options import config_options

    assert BackendOptions().native == native.DEFAULT == ("matmul", "attention")
    assert config_options(load_config(None, environ={})).native == native.DEFAULT
    for value, on in (("1", KERNELS), ("all", KERNELS), ("0", ()), ("attention", ("attention",)),
                      ("matmul,attention", ("matmul", "attention"))):
        assert parse_native(value) == on
        assert config_options(load_config(None, environ={"HETERO_SD_NATIVE": value})).native == on
    with pytest.raises(ValueError, match="unknown kernel 'flash'"):
        parse_native("matmul,flash")
    assert native.kernel_available("matmul", BackendOptions(native=("attention",))) == \
        (False, "off (native: attention,matmul turns it on)")


def test_shapes_it_covers():
    assert native.matmul_fits(1536, 4, 128) and native.matmul_fits(576, 4, 32) and native.matmul_fits(1536, 8, 64)
    assert not native.matmul_fits(576, 4, 128)  # the block must divide K
    assert not native.matmul_fits(96, 4, 32)  # K a multiple of 64
    assert not native.matmul_fits(256, 4, 16) and not native.matmul_fits(256, 6, 32)


@pytest.mark.parametrize("kernels", [pytest.param("matmul", marks=needs_avx2), "0"])
def test_devices_say_which_matmul_runs(kernels):
    registry = discover(BackendOptions(native=parse_native(kernels)))
    cpu = next(d for d in registry.get("onnxruntime").probe() if d.device == "cpu")
    said = "quantized matmul: our BlockMatMul (a GGUF's blocks: GGUFMatMul) or MatMulNBits, the faster exact path " \
        "on this host (timed at a model's first load)" if kernels == "matmul" else \
        "quantized matmul: MatMulNBits; BlockMatMul off (native: matmul turns it on)"
    assert said in cpu.description


@pytest.mark.parametrize("kernels", [pytest.param("matmul", marks=needs_avx2), "0"])
@pytest.mark.parametrize("variant", ["llama", "qwen2", "qwen2-wide"])  # qwen2-wide: 4-bit blocks of 128, zero points
@pytest.mark.parametrize("precision,tol", [("int8", 0.2), ("int4", 1.5)])  # test_graph_backends CASES
def test_the_graph_matches_the_reference(tiny_model_dir, kernels, variant, precision, tol):
    """The graph with BlockMatMul (always), and with MatMulNBits
    (native: off, as on a host that cannot build ours), against transformers'
    logits, prefill and token by token."""
    options = BackendOptions(native=parse_native(kernels), native_matmul="always")
    ir = load_model_ir(tiny_model_dir(variant))
    runner = REGISTRY.get("onnxruntime").load(ir, "cpu", precision, 1 << 20, options=options)
    assert ("by our BlockMatMul" in runner.kernel_choice) == (kernels == "matmul"), runner.kernel_choice
    prompt = random_prompt(30, seed=3)
    ref = reference_logits(ir, prompt).numpy()
    got = runner.forward(runner.allocate(40), prompt, 0, len(prompt))
    assert np.abs(got - ref).max() <= tol * ref.std()
    seq = runner.allocate(40)
    runner.forward(seq, prompt[:20], 0, 1)
    steps = np.stack([runner.forward(seq, [t], 20 + i, 1)[0] for i, t in enumerate(prompt[20:])])
    assert np.abs(steps - ref[20:]).max() <= tol * ref.std()


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_the_lowering_puts_our_op_on_every_quantized_linear_layer(tiny_model_dir, precision):
    """With native_matmul, every MatMulNBits of the graph becomes BlockMatMul on
    the same inputs and attributes (less accuracy_level); without, the graph is
    onnxruntime's own."""
    from hetero_sd.backends.onnx_llama import build_llama_onnx

    ir = load_model_ir(tiny_model_dir("llama"))
    layers = ir.config.num_layers
    ops = {}
    for native_matmul in (True, False):
        proto = build_llama_onnx(ir, precision, attention="native", native_matmul=native_matmul)
        ops[native_matmul] = [n for n in proto.graph.node]
    ours = [n for n in ops[True] if n.op_type == "BlockMatMul"]
    theirs = [n for n in ops[False] if n.op_type == "MatMulNBits"]
    assert not any(n.op_type == "MatMulNBits" for n in ops[True]) and not any(n.op_type == "BlockMatMul" for n in ops[False])
    assert len(ours) == len(theirs) == 4 * layers + 1  # qkv, o, gate+up, down a layer; the head
    for a, b in zip(ours, theirs):
        assert list(a.input) == list(b.input) and a.domain == native.DOMAIN
        assert {x.name: x.i for x in a.attribute} == {x.name: x.i for x in b.attribute if x.name != "accuracy_level"}


@needs_avx2
def test_where_no_padding_makes_matmulnbits_exact_ours_runs(tiny_model_dir, monkeypatch, tmp_path):
    """A host where MatMulNBits rounds rows apart under every padding (its row check
    fails: simulated): the load does not fail, BlockMatMul runs, and its own check passes.
    The failure is cached: a second load checks neither graph again."""
    from hetero_sd.backends import row_check

    real, checked = row_check.check, []

    def check(runner, padding="none"):
        checked.append(bool(runner._libraries))
        if not runner._libraries:  # MatMulNBits' graph
            return False, "row 0 differs (simulated)"
        return real(runner, padding)

    monkeypatch.setattr(row_check, "check", check)
    monkeypatch.setenv("HETERO_SD_CACHE", str(tmp_path))  # no verdict cached by an earlier test
    ours = BackendOptions(native=("matmul",))
    ir = load_model_ir(tiny_model_dir("qwen2"))
    runner = REGISTRY.get("onnxruntime").load(ir, "cpu", "int4", 1 << 20, options=ours)
    assert "by our BlockMatMul (MatMulNBits: no padding is exact on this host)" in runner.kernel_choice
    assert runner.padding == "none" and checked == [False, False, False, True]  # theirs under 3 paddings, ours
    checked.clear()
    again = REGISTRY.get("onnxruntime").load(ir, "cpu", "int4", 1 << 20, options=ours)
    assert "by our BlockMatMul (MatMulNBits: no padding is exact on this host)" in again.kernel_choice
    assert checked == [] and "(cached" in again.kernel_choice
    # MatMulNBits alone (native: off): the cached failure is the load's error
    with pytest.raises(BackendError, match="under every padding.*cached: delete"):
        REGISTRY.get("onnxruntime").load(ir, "cpu", "int4", 1 << 20, options=BackendOptions(native=()))


