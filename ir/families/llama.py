"""The Llama family: Llama 1-3, Mistral, Qwen2/2.5, SmolLM, TinyLlama.

Everything the family needs is here: hyper-parameters from a Hugging Face
config.json or GGUF metadata, GGUF tensor names, and the reference forward that
defines what every backend must compute (tested against transformers).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from hetero_sd.ir import eog
from hetero_sd.ir.config import ModelConfig, MoEConfig
from hetero_sd.ir.errors import ModelLoadError
from hetero_sd.ir.families import decoder
from hetero_sd.ir.families.decoder import rope_inv_freq  # noqa: F401  (re-exported: heads and lowerings use it)


def __getattr__(name: str):
    """`Forward`, the reference forward every family shares, imported when first asked
    for: a backend that never runs it never imports torch."""
    if name == "Forward":
        from hetero_sd.ir.families.forward import Forward

        return Forward
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


HF_MODEL_TYPES = ("llama", "mistral", "qwen2")
GGUF_ARCHS = ("llama", "qwen2")
SUPPORTED_ROPE = ("default", "linear", "llama3")


# ---------------------------------------------------------------- config
def _rope_from_hf(hf: dict, supported=SUPPORTED_ROPE) -> tuple[float, dict | None]:
    # transformers 5 moved rope_theta/rope_scaling into rope_parameters.
    params = dict(hf.get("rope_parameters") or {})
    theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling:
        scaling = dict(scaling)
        scaling["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
    if not scaling or scaling["rope_type"] == "default":
        return float(theta), None
    if scaling["rope_type"] not in supported:
        raise ModelLoadError(
            f"rope_type {scaling['rope_type']!r} is not supported; supported: {', '.join(supported)}")
    return float(theta), scaling


# Families whose configs carry a window that is off unless use_sliding_window.
_WINDOW_SWITCHED = ("qwen2", "qwen3", "qwen3_moe", "smollm3")


def _windows(hf: dict) -> tuple[int | None, tuple | None]:
    """(sliding_window, layer_windows): one window for every layer, or per
    layer from transformers' layer_types ("sliding_attention" layers take it)."""
    window = hf.get("sliding_window")
    if hf.get("model_type") in _WINDOW_SWITCHED and not hf.get("use_sliding_window", False):
        return None, None
    types = hf.get("layer_types")
    if window is None or not types:
        return window, None
    per_layer = tuple(window if t == "sliding_attention" else None for t in types)
    if len(set(per_layer)) == 1:
        return per_layer[0], None
    return window, per_layer


def need(hf: dict, key: str):
    """A config.json key the family cannot do without (a clear error names it)."""
    if key not in hf or hf[key] is None:
        raise ModelLoadError(f"config key {key!r} is missing (model_type {hf.get('model_type')!r} needs it)")
    return hf[key]


def config_from_hf(hf: dict, family: str = "llama", supported_rope=SUPPORTED_ROPE, **extra) -> ModelConfig:
    """The Llama-shaped part of any family's config.json; `extra` sets the
    fields a family adds (ir/config.py)."""
    heads = need(hf, "num_attention_heads")
    # config.json's ids; generation_config.json's and the tokenizer's join them in ir/eog.py (eog_ids)
    eos_ids = eog.id_list(hf.get("eos_token_id"))
    theta, scaling = _rope_from_hf(hf, supported_rope)
    window, layer_windows = _windows(hf)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    partial = hf.get("partial_rotary_factor", (hf.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
        need(hf, key)
    cfg = ModelConfig(
        family=family,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rotary_dim=int(head_dim * partial) if partial != 1.0 else None,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", hf.get("model_type") == "qwen2")),
        sliding_window=window,
        layer_windows=layer_windows,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )
    return dataclasses.replace(cfg, **extra) if extra else cfg


def gguf_getter(fields: dict, arch: str):
    """get(key, default): `{arch}.{key}` from the GGUF metadata; an error naming it when absent without default."""
    def get(key, default=None):
        full = f"{arch}.{key}"
        if full in fields:
            return fields[full]
        if default is None:
            raise ModelLoadError(f"GGUF metadata key {full!r} is missing")
        return default
    return get


def moe_from_gguf(fields: dict, arch: str, width_key: str) -> MoEConfig | None:
    """The experts llama.cpp's metadata describes (every layer sparse, the
    chosen experts' weights renormalised: what llama.cpp computes); None: dense."""
    get = gguf_getter(fields, arch)
    if f"{arch}.expert_count" not in fields:
        return None
    return MoEConfig(num_experts=int(get("expert_count")), experts_per_token=int(get("expert_used_count")),
                     intermediate_size=int(get(width_key)), normalize_topk=True,
                     layers=tuple(range(int(get("block_count")))))


def config_from_gguf(fields: dict, arch: str, tensor_names: set[str], vector=lambda name: None,
                     family: str | None = None, **extra) -> ModelConfig:
    """The Llama-shaped part of any architecture's GGUF metadata; `vector(name)`
    reads a small tensor as floats (None if absent); `extra` as in config_from_hf.
    Arch "llama" with experts is Mixtral."""
    get = gguf_getter(fields, arch)
    if family is None:
        moe = moe_from_gguf(fields, arch, "feed_forward_length")
        family = "mixtral" if moe is not None else "llama"
        if moe is not None:
            extra["moe"] = moe
    rope_freqs = vector("rope_freqs.weight")

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    scaling = None
    kind = fields.get(f"{arch}.rope.scaling.type")
    if kind and kind != "none":
        if kind not in SUPPORTED_ROPE:
            raise ModelLoadError(f"GGUF rope scaling {kind!r} is not supported; supported: linear")
        scaling = {"rope_type": kind, "factor": float(get("rope.scaling.factor"))}
    vocab = fields.get(f"{arch}.vocab_size") or len(fields["tokenizer.ggml.tokens"])
    # eos, eot, eom and the FIM pad/repo/separator ids: llama.cpp's end-of-generation metadata (ir/eog.py)
    eos_ids = tuple(dict.fromkeys(eog.gguf_end_ids(fields, int(vocab)).values()))
    cfg = ModelConfig(
        family=family,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", hidden // heads)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias=arch == "qwen2",
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos_ids,
        rope_freq_factors=rope_freqs,
    )
    return dataclasses.replace(cfg, **extra) if extra else cfg


# ---------------------------------------------------------------- names
weight_names = decoder.weight_names
gguf_name_map = decoder.gguf_name_map


def hf_aliases(cfg: ModelConfig) -> dict[str, str]:
    """Family name -> checkpoint name where they differ: none for Llama."""
    return {}


def hf_fixup(cfg: ModelConfig):
    """A checkpoint's weights need no change for Llama."""
    return None


# Architectures whose Q/K rows llama.cpp's converter permutes (its adjacent-pair RoPE).
PERMUTED_ARCHS = ("llama", "smollm3")


def gguf_fixup(cfg: ModelConfig, arch: str):
    """llama.cpp's converter permutes Llama Q/K rows (interleaved RoPE); undo it."""
    if arch not in PERMUTED_ARCHS:
        return None

    def unpermute(name: str, w: np.ndarray) -> np.ndarray:
        if name.endswith("q_proj.weight"):
            heads = cfg.num_heads
        elif name.endswith("k_proj.weight"):
            heads = cfg.num_kv_heads
        else:
            return w
        rows = w.shape[0]
        return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    return unpermute
