"""GGUF files of the tiny test models (tiny_models.py), converted from their HF folders.

    gguf = make_gguf(path, tmp / "llama.gguf", "Q8_0")   # llama.cpp-style GGUF of the same model
    oracle = make_roundtrip_hf(path, tmp / "rt", "Q8_0")  # HF folder with the GGUF's stored weights

GGUF files are written the way llama.cpp's `convert_hf_to_gguf.py` writes them: arch "llama"
(Llama, Mistral) with the Q/K projection rows permuted for llama.cpp's RoPE layout, arch
"qwen2" (no permute, q/k/v biases), the same tensor names, metadata keys and tokenizer
metadata (via `gguf.SpecialVocab`, which is what the converter uses). The family variants
(Qwen3, Qwen3-MoE, Mixtral, Gemma 3, Phi-3, SmolLM3: tiny_models.FAMILY_VARIANTS) take their
metadata keys and tensor transforms from gguf_families.py. tiny_models re-exports the public
names, so callers may import them from either module.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Sequence

import numpy as np

# Which model types a llama.cpp converter would emit as which GGUF architecture.
GGUF_ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    # the family variants (gguf_families.py)
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe",
    "mixtral": "llama",  # llama.cpp's arch "llama" with experts
    "gemma3_text": "gemma3",
    "phi3": "phi3",
    "smollm3": "smollm3",
}


# ---------------------------------------------------------------------------------------------
# GGUF conversion (mirrors llama.cpp convert_hf_to_gguf.py)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation (HF rotate-half layout -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of `_permute`."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    # what the family variants add
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",  # Phi-3: q|k|v rows, kept fused
    "mlp.gate_up_proj.weight": "ffn_up.weight",  # Phi-3: gate|up rows, kept fused (llama.cpp's ffn_up)
    "mlp.gate.weight": "ffn_gate_inp.weight",  # the MoE router (Qwen3-MoE)
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",  # Mixtral's
}
# Gemma 3's four norms per layer: llama.cpp calls the one before the MLP ffn_norm.
_GEMMA3_LAYER_NAMES = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
# One expert's matrix (Qwen3-MoE, Mixtral's w1/w3/w2): slice `expert` of its layer's stacked
# ffn_{gate,up,down}_exps tensor, [experts, rows, cols] with the expert index ascending.
_EXPERT = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")
_EXPERT_PART = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


def gguf_tensor_name(hf_name: str, arch: str = "llama") -> str:
    """The llama.cpp name of a Hugging Face tensor name in a GGUF of architecture `arch`
    (one expert's matrix: its layer's stacked tensor, see `expert_slice`)."""
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    parts = hf_name.split(".")
    if parts[:2] == ["model", "layers"]:
        rest = ".".join(parts[3:])
        table = {**_LAYER_NAMES, **_GEMMA3_LAYER_NAMES} if arch == "gemma3" else _LAYER_NAMES
        if rest in table:
            return f"blk.{parts[2]}.{table[rest]}"
        if (m := _EXPERT.fullmatch(rest)) is not None:
            return f"blk.{parts[2]}.ffn_{_EXPERT_PART[m.group(2)]}_exps.weight"
    raise KeyError(f"no GGUF name for {hf_name}")


def expert_slice(hf_name: str) -> int | None:
    """The expert index of one expert's matrix (its slice of the stacked tensor); None otherwise."""
    m = _EXPERT.search(hf_name)
    return int(m.group(1)) if m is not None else None


def _read_hf_tensors(hf_dir: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    files = sorted(hf_dir.glob("*.safetensors"))
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def _rope_params(cfg: dict) -> tuple[float, dict | None]:
    """(theta, scaling dict or None) from a config.json, old or new (transformers 5) style."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    return float(theta), (None if rope_type == "default" else dict(rope, rope_type=rope_type))


def _llama3_rope_factors(cfg: dict, theta: float, scaling: dict, head_dim: int) -> np.ndarray:
    """llama.cpp's `rope_freqs.weight` for llama3 rope (LlamaModel.generate_extra_tensors)."""
    base = theta
    dim = head_dim
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor = scaling.get("factor", 8.0)
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context_len = scaling.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    rope_factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            rope_factors.append(1)
        elif wavelen > low_freq_wavelen:
            rope_factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            rope_factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(rope_factors, dtype=np.float32)


def _add_vocab(writer, hf_dir: Path, vocab_size: int) -> None:
    """`_set_vocab_gpt2` of convert_hf_to_gguf: byte-level tokens, types, merges, special ids."""
    import gguf

    tok = json.loads((hf_dir / "tokenizer.json").read_text(encoding="utf-8"))
    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    added = {t["content"]: t for t in tok.get("added_tokens", [])}
    for content, entry in added.items():
        vocab[content] = entry["id"]
    reverse = {i: t for t, i in vocab.items()}
    tokens: list[str] = []
    toktypes: list[int] = []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            toktypes.append(gguf.TokenType.UNUSED)
            continue
        text = reverse[i]
        tokens.append(text)
        if text in added:
            toktypes.append(gguf.TokenType.CONTROL if added[text].get("special") else gguf.TokenType.USER_DEFINED)
        else:
            toktypes.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")  # our pre-tokenizer is the GPT-2 regex + ByteLevel
    writer.add_token_list(tokens)
    writer.add_token_types(toktypes)
    special = gguf.SpecialVocab(hf_dir, load_merges=True)
    special.add_to_gguf(writer)


def make_gguf(hf_dir, out_path, qtype: str = "F32", *, drop: Sequence[str] = (),
              arch: str | None = None, drop_keys: Sequence[str] = ()) -> Path:
    """Convert a saved HF folder (from `make_hf_model`) into a llama.cpp-style GGUF file.

    `drop` (GGUF tensor names to leave out), `drop_keys` (metadata keys to leave out) and
    `arch` (a different general.architecture) exist to build broken files for error-path tests.
    """
    import gguf

    from helpers import gguf_families

    hf_dir, out_path = Path(hf_dir), Path(out_path)
    qtype = qtype.upper()
    ftypes = {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
              "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "Q4_K_M": gguf.LlamaFileType.MOSTLY_Q4_K_M,
              "LEGACY": gguf.LlamaFileType.MOSTLY_Q4_1}
    if qtype not in ftypes:
        raise ValueError(f"qtype must be one of {sorted(ftypes)}, got {qtype!r}")
    cfg = json.loads((hf_dir / "config.json").read_text())
    model_type = cfg["model_type"]
    if model_type not in GGUF_ARCH:
        raise ValueError(f"cannot convert model_type {model_type!r} to GGUF")

    out_path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out_path), arch or GGUF_ARCH[model_type])
    if drop_keys:
        add = writer.add_key_value
        writer.add_key_value = lambda key, *a, **kw: None if key in drop_keys else add(key, *a, **kw)
    writer.add_name(hf_dir.name)
    tensors = _read_hf_tensors(hf_dir)
    if cfg.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    if model_type in gguf_families.MODEL_TYPES:
        gguf_families.add_metadata(writer, cfg, ftypes[qtype])
        _add_vocab(writer, hf_dir, cfg["vocab_size"])
        named = gguf_families.gguf_tensors(cfg, tensors, hf_dir)
    else:
        extra = _add_llama_metadata(writer, cfg, ftypes[qtype], qtype)
        _add_vocab(writer, hf_dir, cfg["vocab_size"])
        named = _llama_tensors(cfg, tensors) + list(extra.items())
    for gname, data in named:
        if gname not in drop:
            _add_tensor(writer, gname, data, qtype)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def _add_llama_metadata(writer, cfg: dict, ftype, qtype: str) -> dict[str, np.ndarray]:
    """The metadata keys of arch "llama" / "qwen2"; returns the extra tensors (llama3's rope_freqs)."""
    import gguf

    n_head = cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads") or n_head
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head
    theta, scaling = _rope_params(cfg)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(theta)
    writer.add_rope_dimension_count(head_dim)
    if head_dim != cfg["hidden_size"] // n_head:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_file_type(ftype)
    if qtype != "F32":
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    extra: dict[str, np.ndarray] = {}
    if scaling is not None:
        rope_type = scaling["rope_type"]
        if rope_type == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(float(scaling["factor"]))
        elif rope_type == "yarn":
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(float(scaling["factor"]))
            writer.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))
        elif rope_type == "llama3":
            # llama.cpp writes no scaling keys for llama3; it stores per-frequency divisors instead.
            extra["rope_freqs.weight"] = _llama3_rope_factors(cfg, theta, scaling, head_dim)
        else:
            raise ValueError(f"rope type {rope_type!r} has no GGUF form here")
    # mistral sliding_window: llama.cpp's arch "llama" has no key for it, so it is dropped.
    return extra


def tensor_order(name: str):
    """The order tensors are written in: the embedding, the layers in turn, then the rest."""
    if name == "model.embed_tokens.weight":
        return (0, 0, name)
    if name.startswith("model.layers."):
        return (1, int(name.split(".")[2]), name)
    return (2, 0, name)


def _llama_tensors(cfg: dict, tensors: dict[str, np.ndarray]) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array) of arch "llama" (Q/K rows permuted) / "qwen2"."""
    permute = GGUF_ARCH[cfg["model_type"]] == "llama"
    n_head = cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads") or n_head
    out = []
    for name in sorted(tensors, key=tensor_order):
        data = tensors[name].astype(np.float32)
        if permute and name.endswith("self_attn.q_proj.weight"):
            data = _permute(data, n_head)
        elif permute and name.endswith("self_attn.k_proj.weight"):
            data = _permute(data, n_kv)
        out.append((gguf_tensor_name(name), data))
    return out


def _storage_type(gguf_name: str, shape: tuple[int, ...], qtype: str) -> str:
    """The type convert_hf_to_gguf stores a tensor as: 1-D, norms and MoE routers stay F32;
    Q8_0 needs rows of a multiple of 32 elements and falls back to F16 otherwise."""
    from helpers.gguf_mixes import MIXES

    if len(shape) <= 1 or gguf_name.endswith(("_norm.weight", "ffn_gate_inp.weight")) or qtype == "F32":
        return "F32"
    if qtype != "F16" and shape[-1] % 32 != 0:
        return "F16"
    return MIXES[qtype](gguf_name, shape) if qtype in MIXES else qtype


def _add_tensor(writer, name: str, data: np.ndarray, qtype: str) -> None:
    import gguf

    kind = _storage_type(name, data.shape, qtype)
    if kind == "F32":
        writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    elif kind == "F16":
        writer.add_tensor(name, data.astype(np.float16))
    else:  # a block type
        from helpers.gguf_mixes import encode

        # rows of blocks: a stacked [experts, rows, cols] tensor quantizes as experts*rows rows
        q = encode(kind, data.reshape(-1, data.shape[-1])).reshape(*data.shape[:-1], -1)
        # q is uint8 [..., rows, bytes per row]; with raw_dtype set the writer turns that byte
        # shape back into the element shape (and reverses it to ggml's order on disk).
        writer.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType[kind])


def roundtrip(array: np.ndarray, kind: str) -> np.ndarray:
    """What a GGUF file stored as `kind` ("F32", "F16", "Q8_0") gives back for `array`."""
    import gguf

    array = np.ascontiguousarray(array, dtype=np.float32)
    if kind == "F32":
        return array
    if kind == "F16":
        return array.astype(np.float16).astype(np.float32)
    from helpers.gguf_mixes import encode

    return gguf.quants.dequantize(encode(kind, array), gguf.GGMLQuantizationType[kind]).astype(np.float32)


def make_roundtrip_hf(hf_dir, out_dir, qtype: str) -> Path:
    """A copy of an HF folder whose weights went through `make_gguf(..., qtype)` storage and back.

    Its `hf_logits` are the exact oracle for a GGUF of that qtype: Q/K permutation commutes with
    Q8_0 (which quantizes blocks of 32 within a row, and the permutation only moves whole rows),
    and so does stacking experts. Norms are stored F32, so Gemma's 1 + w comes back exactly and
    the copy keeps w.
    """
    import shutil

    from safetensors import safe_open
    from safetensors.numpy import save_file

    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    qtype = qtype.upper()
    arch = GGUF_ARCH[json.loads((hf_dir / "config.json").read_text())["model_type"]]
    if out_dir.exists():
        shutil.rmtree(out_dir)
    shutil.copytree(hf_dir, out_dir)
    for f in sorted(out_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="np") as h:
            meta = h.metadata()
            arrays = {k: h.get_tensor(k) for k in h.keys()}
        for k, v in arrays.items():
            arrays[k] = roundtrip(v, _storage_type(gguf_tensor_name(k, arch), v.shape, qtype)).astype(v.dtype)
        save_file(arrays, str(f), metadata=meta)
    return out_dir
