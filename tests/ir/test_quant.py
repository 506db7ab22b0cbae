"""GGUF blocks as block-affine integers (ir/quant.py): bit-exact against gguf's
own dequantizer, for random bytes of every type and for real encoded weights."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from hetero_sd.ir import load_model_ir, quant
from helpers.gguf_mixes import encode


def _bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.ascontiguousarray(a, np.float32), np.ascontiguousarray(b, np.float32)
    same = a.view(np.uint32) == b.view(np.uint32)
    return bool((same | (np.isnan(a) & np.isnan(b))).all())


@pytest.mark.parametrize("kind", sorted(quant.SUPPORTED))
@pytest.mark.parametrize("seed", range(3))
def test_random_blocks_decode_bit_exactly(kind, seed):
    """Any byte pattern is a valid block: every scale, minimum and integer
    layout is hit, and the decoded form must dequantize to gguf's bits."""
    per, size = quant.SUPPORTED[kind]
    rows, cols = 6, 2 * 256
    data = np.random.default_rng(seed).integers(0, 256, (rows, cols // per * size), dtype=np.uint8)
    with np.errstate(all="ignore"):
        ref = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[kind])
        blocks = quant.decode(kind, data, rows, cols)
        got = quant.dequantize(blocks)
    assert got.shape == (rows, cols) and blocks.q.max() < 2 ** blocks.bits
    assert _bits_equal(got, ref)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q6_K"])
def test_encoded_weights_decode_bit_exactly(kind):
    w = np.random.default_rng(1).standard_normal((8, 512)).astype(np.float32) * 0.05
    data = encode(kind, w)
    ref = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[kind])
    assert np.abs(ref - w).max() < 0.05 * 0.5  # the test encoders make sane weights
    assert _bits_equal(quant.dequantize(quant.decode(kind, data, 8, 512)), ref)


def test_unsupported_type_and_wrong_size_are_named():
    with pytest.raises(ValueError, match="IQ2_XS.*supported: Q4_0"):
        quant.decode("IQ2_XS", np.zeros(66, np.uint8), 1, 256)
    with pytest.raises(ValueError, match="expected 2 x 64"):
        quant.decode("Q8_0", np.zeros(34, np.uint8), 2, 64)


def test_gguf_source_gives_blocks_with_llama_rows_unpermuted(tiny_model_dir, tiny_gguf):
    """The LEGACY mix stores Llama's permuted Q/K rows in 32-blocks: the blocks
    come back in Hugging Face row order, equal to the float path's tensor."""
    model = load_model_ir(tiny_gguf("llama-wide", "LEGACY"))
    src = model.weights
    for name in src.names():
        blocks = src.blocks(name)
        if blocks is None:
            assert src.type_name(name) in ("F32", "F16")
            continue
        assert _bits_equal(quant.dequantize(blocks), src.get(name).numpy()), name


def test_shaped_gguf_helper_writes_a_loadable_model(tmp_path):
    """The helper behind the 7B-shaped memory figures (docs/bigger-models.md): streamed
    random blocks in a Q4_K_M mix, loadable and finite on the gguf path."""
    from hetero_sd.backends.registry import discover
    from helpers.shaped_gguf import write_shaped_gguf

    model = load_model_ir(write_shaped_gguf("tiny", tmp_path / "tiny.gguf"))
    kinds = {model.weights.type_name(n) for n in model.weight_names()}
    assert {"Q4_K", "Q6_K", "F32"} <= kinds
    runner = discover().get("onnxruntime").load(model, "cpu", "gguf", 1 << 20)
    assert np.isfinite(runner.forward(runner.allocate(8), [1, 2, 3], 0, 3)).all()
