"""Precision `gguf` on the graph backends: a GGUF's own blocks kept as the
runtime's integers (backends/onnx_weights.py). The weights the runtimes compute
with equal gguf's dequantization bit for bit; logits match transformers on the
round-tripped weights; verify rows equal one-token steps; the lowering streams
to external data and never holds the model in memory."""
from __future__ import annotations

import tracemalloc

import gguf
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from hetero_sd.backends import onnx_weights
from hetero_sd.backends.onnx_llama import build_llama_onnx
from hetero_sd.backends.registry import discover
from hetero_sd.ir.weights import WeightSource
from hetero_sd.ir import load_model_ir, quant
from helpers.gguf_mixes import encode
from helpers.tiny_models import hf_logits, random_prompt

REGISTRY = discover()
BACKENDS = ("onnxruntime", "openvino")
MIXES = [("qwen2-wide", "Q4_K_M"), ("llama-wide", "LEGACY")]


def _linear_model(blocks: quant.Blocks, path) -> None:
    """A graph that is one `gguf` linear layer, y = x W^T, weights external."""
    b = onnx_weights.Builder(path.parent / "weights.bin")
    lin = onnx_weights.Linears(b, _OneWeight(blocks), "gguf")
    lin("x", ["w"], out="y")
    b.close()
    n, k = blocks.shape
    graph = helper.make_graph(b.nodes, "linear", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", n])], b.inits)
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                            helper.make_opsetid("com.microsoft", 1)]), str(path))


class _OneWeight(WeightSource):
    has_blocks = True

    def __init__(self, blocks):
        self._blocks = blocks

    def blocks(self, name):
        return self._blocks


def _run(backend: str, path, x: np.ndarray) -> np.ndarray:
    if backend == "onnxruntime":
        import onnxruntime as ort

        return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    import openvino as ov

    compiled = ov.Core().compile_model(str(path), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    return compiled({"x": x})[0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", sorted(quant.SUPPORTED))
def test_runtime_weights_are_the_files_bit_for_bit(backend, kind, tmp_path, monkeypatch):
    """Multiplying the identity reads the weights the runtime computes with
    (fp32 compute, so nothing but the weights can round): they must be
    gguf.quants.dequantize's, bitwise, for every block type we take."""
    monkeypatch.setattr(onnx_weights, "ACCURACY_LEVEL", 0)
    per, size = quant.SUPPORTED[kind]
    rng = np.random.default_rng(7)
    n, k = 24, 512
    if kind in ("Q4_K", "Q6_K"):
        data = encode(kind, rng.standard_normal((n, k)).astype(np.float32))
    else:  # random bytes with finite fp16 fields: every layout and zero point
        data = rng.integers(0, 256, (n, k // per * size), dtype=np.uint8)
        halves = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q5_K": (0, 2)}[kind]
        blocks = data.reshape(-1, size)
        for at in halves:
            blocks[:, at:at + 2] = (rng.standard_normal(len(blocks)) * 0.01).astype(np.float16).view(np.uint8) \
                .reshape(-1, 2)
    ref = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[kind])
    _linear_model(quant.decode(kind, data, n, k), tmp_path / "linear.onnx")
    got = _run(backend, tmp_path / "linear.onnx", np.eye(k, dtype=np.float32)).T
    # bitwise but for the sign of zero, which a matmul's sum cannot carry (+0 + -0 = +0)
    same = (got.view(np.uint32) == ref.astype(np.float32).view(np.uint32)) | ((got == 0) & (ref == 0))
    assert same.all(), f"{(~same).sum()} of {same.size} weights differ"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant,mix", MIXES)
def test_gguf_precision_logits_match_transformers(backend, variant, mix, tiny_gguf, tiny_roundtrip_dir):
    """transformers on the same (round-tripped) weights is the oracle. With the
    weights exact, what is left: onnxruntime quantizes activations to int8 per
    block (accuracy level 4, as llama.cpp does for its dot products), measured
    0.07-0.12 of the logits' spread here; OpenVINO computes in f32 (~5e-6)."""
    model = load_model_ir(tiny_gguf(variant, mix))
    prompt = random_prompt(24, seed=4)
    ref = hf_logits(tiny_roundtrip_dir(variant, mix), prompt).numpy()
    runner = REGISTRY.get(backend).load(model, "cpu", "gguf", 1 << 20)
    got = runner.forward(runner.allocate(32), prompt, 0, len(prompt))
    tolerance = {"onnxruntime": 0.2, "openvino": 1e-4}[backend]
    assert np.abs(got - ref).max() < tolerance * ref.std()
    fp32 = REGISTRY.get(backend).load(model, "cpu", "fp32", 1 << 20)  # the float path on the same file
    assert np.abs(fp32.forward(fp32.allocate(32), prompt, 0, len(prompt)) - ref).max() < 1e-3


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant,mix", MIXES)
def test_gguf_precision_is_batch_invariant(backend, variant, mix, tiny_gguf):
    runner = REGISTRY.get(backend).load(load_model_ir(tiny_gguf(variant, mix)), "cpu", "gguf", 1 << 20)
    assert runner.precision.batch_invariant
    runner.WINDOW_BLOCK = 16
    seq = runner.allocate(64)
    prompt, cont = random_prompt(12, seed=1), random_prompt(17, seed=2)
    runner.forward(seq, prompt, 0, 1)
    single = np.stack([runner.forward(seq, [t], 12 + i, 1)[0] for i, t in enumerate(cont)])
    for width in range(2, 18):
        runner.truncate(seq, 12)
        assert np.array_equal(runner.forward(seq, cont[:width], 12, width), single[:width]), width


def test_gguf_precision_needs_a_gguf_file(tiny_model_dir):
    from hetero_sd.errors import HeteroSDError

    with pytest.raises((HeteroSDError, ValueError), match="needs a GGUF model"):
        REGISTRY.get("onnxruntime").load(load_model_ir(tiny_model_dir("qwen2")), "cpu", "gguf", 1 << 20)


@pytest.mark.parametrize("precision", ["fp32", "int4", "gguf"])
def test_lowering_streams_weights_to_external_data(tiny_gguf, tmp_path, precision):
    """The proto holds references, the weights sit in weights.bin, and the
    build's peak Python-heap memory stays a fraction of the model's float size
    (it used to be several times it): tensors are written one at a time."""
    model = load_model_ir(tiny_gguf("qwen2-wide", "Q4_K_M"))
    floats = sum(model.weights.get(n).numel() * 4 for n in model.weight_names())
    tracemalloc.start()
    try:
        build_llama_onnx(model, precision, tmp_path / "model.onnx")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    proto = onnx.load(str(tmp_path / "model.onnx"), load_external_data=False)
    external = [t for t in proto.graph.initializer if t.data_location == TensorProto.EXTERNAL]
    assert external and (tmp_path / "weights.bin").stat().st_size > 0
    assert (tmp_path / "model.onnx").stat().st_size < 200_000
    largest = max(model.weights.get(n).numel() * 4 for n in model.weight_names())
    # a fused group (gate+up: two tensors) with its transposed copy is the
    # working set; the whole model in floats (what the lowering used to hold,
    # then copy into the proto) must never be reached
    assert peak < 8 * largest and peak < 0.75 * floats, (peak, largest, floats)


def _mapped_rss_kb(path) -> int:
    """This process's resident kB of the mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if len(head) >= 5 and "-" in head[0] and ":" not in head[0]:
                inside = line.rstrip().endswith(str(path))
            elif inside and line.startswith("Rss:"):
                total += int(head[1])
    return total


def test_lowering_leaves_the_gguf_pages_out_of_the_resident_set(tmp_path):
    """The file's mapped pages are dropped after the lowering read them all
    (they counted again on top of the runtime's copy: 14.2 GiB cold against
    9.5 warm on a 7B-shaped file). Read back through the map, nothing changed."""
    from helpers.shaped_gguf import write_shaped_gguf

    path = write_shaped_gguf("tiny", tmp_path / "t.gguf").resolve()
    model = load_model_ir(path)
    before = model.weights.get("lm_head.weight").numpy().copy()
    np.asarray(model.weights._data).sum()  # touch every page
    assert _mapped_rss_kb(path) * 1024 > 0.9 * path.stat().st_size
    build_llama_onnx(model, "gguf", tmp_path / "model.onnx")
    assert _mapped_rss_kb(path) * 1024 < 0.1 * path.stat().st_size
    assert np.array_equal(model.weights.get("lm_head.weight").numpy(), before)
