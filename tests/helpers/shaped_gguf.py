"""A GGUF of a real model's shape with random weights, written tensor by tensor
(never whole in memory), for memory and load-time measurements of models too
big to ship: no tokenizer, no meaningful output, real block types.

    python tests/helpers/shaped_gguf.py qwen2.5-7b /tmp/qwen7b-shape.gguf   # ~4.7 GB, Q4_K_M mix
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

# name -> (hidden, intermediate, layers, heads, kv heads, vocab, tied)
SHAPES = {
    "qwen2.5-7b": (3584, 18944, 28, 28, 4, 152064, False),
    "qwen2.5-1.5b": (1536, 8960, 28, 12, 2, 151936, False),
    "tiny": (256, 512, 2, 4, 2, 384, False),
}


def _q4_k_m(name: str) -> str:
    return "Q6_K" if name.endswith(("attn_v.weight", "ffn_down.weight", "output.weight")) else "Q4_K"


def _tensors(hidden, inter, layers, heads, kv, vocab, tied):
    head_dim = hidden // heads
    yield "token_embd.weight", (vocab, hidden)
    for i in range(layers):
        p = f"blk.{i}."
        yield p + "attn_norm.weight", (hidden,)
        yield p + "attn_q.weight", (hidden, hidden)
        yield p + "attn_k.weight", (kv * head_dim, hidden)
        yield p + "attn_v.weight", (kv * head_dim, hidden)
        for n, size in (("q", hidden), ("k", kv * head_dim), ("v", kv * head_dim)):
            yield p + f"attn_{n}.bias", (size,)
        yield p + "attn_output.weight", (hidden, hidden)
        yield p + "ffn_norm.weight", (hidden,)
        yield p + "ffn_gate.weight", (inter, hidden)
        yield p + "ffn_up.weight", (inter, hidden)
        yield p + "ffn_down.weight", (hidden, inter)
    yield "output_norm.weight", (hidden,)
    if not tied:
        yield "output.weight", (vocab, hidden)


def _random_blocks(kind: str, rows: int, cols: int, rng) -> np.ndarray:
    """Random blocks whose fp16 scale fields are small and finite (weights ~ +-0.1)."""
    import gguf

    per, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    data = rng.integers(0, 256, (rows * cols // per, size), dtype=np.uint8)
    at = {"Q4_K": (0, 2), "Q6_K": (208,)}[kind]
    scale = {"Q4_K": 1e-3, "Q6_K": 2e-5}[kind]
    for offset in at:
        data[:, offset:offset + 2] = (rng.random(len(data)) * scale).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return data.reshape(rows, -1)


def write_shaped_gguf(shape: str, path: str | Path, seed: int = 0) -> Path:
    import gguf

    hidden, inter, layers, heads, kv, vocab, tied = SHAPES[shape]
    path = Path(path)
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_name(f"{shape} shape, random weights")
    for key, value in (("context_length", 32768), ("embedding_length", hidden), ("block_count", layers),
                       ("feed_forward_length", inter), ("head_count", heads), ("head_count_kv", kv)):
        getattr(w, f"add_{key}")(value)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    tensors = list(_tensors(hidden, inter, layers, heads, kv, vocab, tied))
    for name, shp in tensors:
        if len(shp) == 1:
            w.add_tensor_info(name, shp, np.dtype(np.float32), shp[0] * 4)
        else:
            kind = gguf.GGMLQuantizationType[_q4_k_m(name)]
            per, size = gguf.GGML_QUANT_SIZES[kind]
            w.add_tensor_info(name, (shp[0], shp[1] // per * size), np.dtype(np.uint8),
                              shp[0] * shp[1] // per * size, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shp in tensors:
        if len(shp) == 1:
            data = (1.0 if name.endswith("norm.weight") else 0.0) + rng.standard_normal(shp).astype(np.float32) * 0.01
            w.write_tensor_data(data.astype(np.float32))
        else:
            w.write_tensor_data(_random_blocks(_q4_k_m(name), shp[0], shp[1], rng))
    w.close()
    return path


if __name__ == "__main__":
    print(write_shaped_gguf(sys.argv[1], sys.argv[2]))
