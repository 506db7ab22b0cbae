"""GGUF form of the family variants (tiny_models.FAMILY_VARIANTS), as llama.cpp's converter
writes them (its classes in conversion/qwen.py, llama.py, gemma.py and phi.py):

    model_type    arch       beyond renaming (gguf_convert.gguf_tensor_name)
    qwen3         qwen3      nothing
    qwen3_moe     qwen3moe   experts stacked; expert_feed_forward_length
    mixtral       llama      Q/K rows permuted; experts stacked; vocab_size, rope.dimension_count
    gemma3_text   gemma3     +1 on every *norm.weight; rope.freq_base_swa, attention.sliding_window,
                             final_logit_softcapping; lm_head never written
    phi3          phi3       keys of its own (rope.dimension_count, original context length,
                             rope.scaling.attn_factor), rope_factors_long/short tensors;
                             qkv_proj and gate_up_proj stay fused (attn_qkv, ffn_up)
    smollm3       smollm3    as Llama: Q/K rows permuted; vocab_size, rope.dimension_count; no NoPE key

A layer's experts become one [experts, rows, cols] tensor per matrix (ffn_{gate,up,down}_exps,
expert index ascending); the router (ffn_gate_inp) is stored F32 whatever the qtype.
`make_gguf` calls `add_metadata` and `gguf_tensors`; the tokenizer keys are the same for all.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from helpers.gguf_convert import GGUF_ARCH, _permute, expert_slice, gguf_tensor_name, tensor_order

MODEL_TYPES = ("qwen3", "qwen3_moe", "mixtral", "gemma3_text", "phi3", "smollm3")
# Archs with llama.cpp's adjacent-pair ("NORM") RoPE: the converter permutes their Q/K rows.
PERMUTED_ARCHS = ("llama", "smollm3")


# ---------------------------------------------------------------------------------------------
# metadata


def rope_parameters(cfg: dict) -> dict:
    """TextModel's rope_parameters: the config's (or legacy rope_scaling), with rope_theta and
    friends mirrored in unless it is per layer type (Gemma 3: full_attention / sliding_attention)."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if "full_attention" not in rope and "sliding_attention" not in rope:
        if cfg.get("rope_local_base_freq") is not None:
            rope["sliding_attention"] = {"rope_theta": cfg["rope_local_base_freq"]}
        for key in ("rope_theta", "partial_rotary_factor", "original_max_position_embeddings"):
            if key not in rope and cfg.get(key) is not None:
                rope[key] = cfg[key]
        if "rope_type" not in rope and "type" in rope:
            rope["rope_type"] = rope["type"]
    return rope


def _text_model_keys(w, cfg: dict, rope: dict, ftype) -> None:
    """TextModel.set_gguf_parameters: the keys every arch here but phi3 starts from."""
    import gguf

    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    if cfg.get("num_key_value_heads") is not None:
        w.add_head_count_kv(cfg["num_key_value_heads"])
    full = rope.get("full_attention", rope)  # the global layers' RoPE
    kind = full.get("rope_type", "default")
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    elif kind in ("su", "longrope"):
        w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
    elif kind != "default":
        raise ValueError(f"rope type {kind!r} has no GGUF form here")
    if full.get("rope_theta") is not None:
        w.add_rope_freq_base(full["rope_theta"])
    if (local_theta := rope.get("sliding_attention", {}).get("rope_theta")) is not None:
        w.add_rope_freq_base_swa(local_theta)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if (experts := cfg.get("num_local_experts", cfg.get("num_experts"))) is not None:
        w.add_expert_count(experts)
    if cfg.get("num_experts_per_tok") is not None:
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("head_dim") is not None:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    w.add_file_type(ftype)


def _phi3_keys(w, cfg: dict, rope: dict, ftype) -> None:
    """Phi3MiniModel.set_gguf_parameters (it does not start from TextModel's) and the
    attention factor its generate_extra_tensors writes for longrope."""
    n_embd, n_head = cfg["hidden_size"], cfg["num_attention_heads"]
    max_pos, orig = cfg["max_position_embeddings"], rope["original_max_position_embeddings"]
    w.add_context_length(max_pos)
    w.add_rope_scaling_orig_ctx_len(orig)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count(n_head)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * n_embd) // n_head)
    w.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    w.add_file_type(ftype)
    w.add_sliding_window(cfg.get("sliding_window") or 0)  # 0: "no window" (Phi-4)
    if rope.get("long_factor"):
        scale, kind = max_pos / orig, rope.get("rope_type", "").lower()
        if kind in ("su", "longrope"):
            factor = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0
        elif kind == "yarn":
            factor = 0.1 * math.log(scale) + 1.0 if scale > 1.0 else 1.0
        else:
            raise ValueError(f"phi3 rope type {kind!r} has no GGUF form")
        w.add_rope_scaling_attn_factors(factor)


def add_metadata(writer, cfg: dict, ftype) -> None:
    """The architecture's keys (everything but general.name and the tokenizer's)."""
    import gguf

    arch, rope = GGUF_ARCH[cfg["model_type"]], rope_parameters(cfg)
    if arch == "phi3":
        _phi3_keys(writer, cfg, rope, ftype)
    else:
        _text_model_keys(writer, cfg, rope, ftype)
    if arch == "qwen3moe":  # Qwen2MoeModel
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size") is not None:
            writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    elif arch in PERMUTED_ARCHS:  # LlamaModel (Mixtral, SmolLM3)
        writer.add_vocab_size(cfg["vocab_size"])
        writer.add_rope_dimension_count(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    elif arch == "gemma3":
        # Gemma3Model re-writes TextModel's keys with its defaults (the same values when the
        # config has them), then adds these; it writes no sliding-window pattern.
        if cfg.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        if cfg.get("sliding_window_pattern") != 1:
            writer.add_sliding_window(cfg["sliding_window"])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)  # ModelBase.prepare_metadata


# ---------------------------------------------------------------------------------------------
# tensors


def _phi3_rope_factors(cfg: dict) -> list[tuple[str, np.ndarray]]:
    """Phi3MiniModel.generate_extra_tensors: longrope's factors (written before the weights)."""
    rope = rope_parameters(cfg)
    if not rope.get("long_factor"):
        return []
    return [("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32)),
            ("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))]


def _vocab_rows(hf_dir: Path) -> int:
    """Gemma3Model's real vocabulary size (token_embd is cut to it): tokenizer.json's entries."""
    import json

    tok = json.loads((hf_dir / "tokenizer.json").read_text(encoding="utf-8"))
    return len(tok["model"]["vocab"]) + len(tok["added_tokens"])


def _modify(cfg: dict, arch: str, name: str, data: np.ndarray, hf_dir: Path) -> np.ndarray:
    """The converter's modify_tensors, before renaming: Q/K permutation, Gemma's +1 and vocab cut."""
    if arch in PERMUTED_ARCHS:
        n_head = cfg["num_attention_heads"]
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            data = _permute(data, n_head)
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            data = _permute(data, cfg.get("num_key_value_heads") or n_head)
    if arch == "gemma3":
        if name.endswith("embed_tokens.weight"):
            data = data[:_vocab_rows(hf_dir)]
        if name.endswith("norm.weight"):
            data = data + np.float32(1.0)  # Gemma's norms multiply by 1 + w; llama.cpp's by w
    return data


def gguf_tensors(cfg: dict, tensors: dict[str, np.ndarray], hf_dir: Path) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array) in writing order; each layer's experts stacked [E, rows, cols]."""
    arch = GGUF_ARCH[cfg["model_type"]]
    n_experts = cfg.get("num_local_experts", cfg.get("num_experts"))
    out = _phi3_rope_factors(cfg) if arch == "phi3" else []
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for name in sorted(tensors, key=tensor_order):
        if arch == "gemma3" and name == "lm_head.weight":
            continue  # Gemma3Model.filter_tensors: llama.cpp never uses it
        data = _modify(cfg, arch, name, tensors[name].astype(np.float32), hf_dir)
        gname, expert = gguf_tensor_name(name, arch), expert_slice(name)
        if expert is None:
            out.append((gname, data))
            continue
        stacks.setdefault(gname, {})[expert] = data
        if len(stacks[gname]) == n_experts:  # the layer's last expert of this matrix
            parts = stacks.pop(gname)
            out.append((gname, np.stack([parts[e] for e in range(n_experts)])))
    if stacks:
        raise ValueError(f"incomplete expert stacks: {sorted(stacks)}")
    return out
