"""The Llama family: Llama 1-3, Mistral, Qwen2/2.5, SmolLM, TinyLlama.

Everything the family needs is here: hyper-parameters from a Hugging Face
config.json or GGUF metadata, GGUF tensor names, and the reference forward that
defines what every backend must compute (tested against transformers).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from hetero_sd.ir.config import ModelConfig
from hetero_sd.ir.errors import ModelLoadError

HF_MODEL_TYPES = ("llama", "mistral", "qwen2")
GGUF_ARCHS = ("llama", "qwen2")
SUPPORTED_ROPE = ("default", "linear", "llama3")


# ---------------------------------------------------------------- config
def _rope_from_hf(hf: dict) -> tuple[float, dict | None]:
    # transformers 5 moved rope_theta/rope_scaling into rope_parameters.
    params = dict(hf.get("rope_parameters") or {})
    theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling:
        scaling = dict(scaling)
        scaling["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
    if not scaling or scaling["rope_type"] == "default":
        return float(theta), None
    if scaling["rope_type"] not in SUPPORTED_ROPE:
        raise ModelLoadError(
            f"rope_type {scaling['rope_type']!r} is not supported; supported: {', '.join(SUPPORTED_ROPE)}")
    return float(theta), scaling


def config_from_hf(hf: dict) -> ModelConfig:
    heads = hf["num_attention_heads"]
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    theta, scaling = _rope_from_hf(hf)
    window = hf.get("sliding_window")
    if hf.get("model_type") == "qwen2" and not hf.get("use_sliding_window", False):
        window = None  # Qwen2 configs carry a window that is off unless use_sliding_window
    return ModelConfig(
        family="llama",
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", hf.get("model_type") == "qwen2")),
        sliding_window=window,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def config_from_gguf(fields: dict, arch: str, tensor_names: set[str],
                     rope_freqs: tuple[float, ...] | None = None) -> ModelConfig:
    def get(key, default=None):
        full = f"{arch}.{key}"
        if full in fields:
            return fields[full]
        if default is None:
            raise ModelLoadError(f"GGUF metadata key {full!r} is missing")
        return default

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    scaling = None
    kind = fields.get(f"{arch}.rope.scaling.type")
    if kind and kind != "none":
        if kind not in SUPPORTED_ROPE:
            raise ModelLoadError(f"GGUF rope scaling {kind!r} is not supported; supported: linear")
        scaling = {"rope_type": kind, "factor": float(get("rope.scaling.factor"))}
    vocab = fields.get(f"{arch}.vocab_size") or len(fields["tokenizer.ggml.tokens"])
    eos = fields.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        family="llama",
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
        eos_token_ids=(int(eos),) if eos is not None else (),
        rope_freq_factors=rope_freqs,
    )


# ---------------------------------------------------------------- names
def weight_names(cfg: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + f"self_attn.{n}_proj.weight" for n in "qkvo"]
        names += [p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
        if cfg.attention_bias:
            names += [p + f"self_attn.{n}_proj.bias" for n in "qkv"]
    return names


_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name_map(cfg: ModelConfig) -> dict[str, str]:
    out = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    for i in range(cfg.num_layers):
        for hf, gg in _GGUF_LAYER.items():
            out[f"model.layers.{i}.{hf}"] = f"blk.{i}.{gg}"
    return out


def gguf_fixup(cfg: ModelConfig, arch: str):
    """llama.cpp's converter permutes Llama Q/K rows (interleaved RoPE); undo it."""
    if arch != "llama":
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


# ---------------------------------------------------------------- forward
def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if cfg.rope_freq_factors is not None:  # GGUF stores llama3 scaling as divisors
        return inv / torch.tensor(cfg.rope_freq_factors, dtype=torch.float32)
    sc = cfg.rope_scaling
    if sc is None:
        return inv
    if sc["rope_type"] == "linear":
        return inv / sc["factor"]
    # llama3: keep high frequencies, divide low ones by factor, blend between.
    factor, old = sc["factor"], sc["original_max_position_embeddings"]
    low_wl, high_wl = old / sc["low_freq_factor"], old / sc["high_freq_factor"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wl, inv / factor, inv)
    smooth = (old / wavelen - sc["low_freq_factor"]) / (sc["high_freq_factor"] - sc["low_freq_factor"])
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wl) * ~(wavelen > low_wl)
    return torch.where(medium, smoothed, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Forward(torch.nn.Module):
    """Tokens at positions [start, start+T) against a KV cache holding [0, start).

    The caller owns the cache: `k_cache`/`v_cache` are [layers, kv_heads,
    capacity, head_dim] views into its pool; this writes the new positions and
    reads the prefix, so rollback is the caller's length, never a copy.
    """

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 exact_linear=None):
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        self.w = weights
        self.lm_head = weights["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
        # A backend may pass a matmul whose per-row results do not depend on
        # how many rows run together; forward(exact=True) then uses it with a
        # row-wise attention (batch invariance). Otherwise: the fastest ops.
        self._exact_mm = exact_linear
        self.inv_freq = rope_inv_freq(cfg)

    def _linear(self, mm, x, name, bias=False):
        return mm(x, self.w[name + ".weight"], self.w.get(name + ".bias") if bias else None)

    def _norm(self, x, weight):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        return weight * h.to(x.dtype)

    def _rope(self, start: int, n: int):
        pos = torch.arange(start, start + n, dtype=torch.float32)
        freqs = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def _mask(self, start: int, n: int) -> torch.Tensor:
        q = torch.arange(start, start + n)[:, None]
        k = torch.arange(start + n)[None, :]
        allowed = k <= q
        if self.cfg.sliding_window is not None:
            allowed &= (q - k) < self.cfg.sliding_window
        return allowed

    def _attend(self, q, k, v, start, mask):
        gqa = self.cfg.num_heads != self.cfg.num_kv_heads
        if mask is not None:
            end = start + q.shape[1]
            return F.scaled_dot_product_attention(q, k[:, :end], v[:, :end], attn_mask=mask, enable_gqa=gqa)
        # One query row at a time over exactly its visible keys: the same shapes
        # a one-token decode at that position uses, hence the same rounding.
        rows = []
        for t in range(q.shape[1]):
            lo, hi = self._visible(start + t)
            rows.append(F.scaled_dot_product_attention(q[:, t:t + 1], k[:, lo:hi], v[:, lo:hi], enable_gqa=gqa))
        return torch.cat(rows, dim=1)

    def _visible(self, pos: int) -> tuple[int, int]:
        window = self.cfg.sliding_window
        return (max(0, pos + 1 - window) if window else 0), pos + 1

    def forward(self, tokens: torch.Tensor, start: int, k_cache: torch.Tensor,
                v_cache: torch.Tensor, num_logits: int = 1, exact: bool = False,
                features: list | None = None) -> torch.Tensor:
        return self.forward_batch([(tokens, start, k_cache, v_cache, num_logits)], exact, features)[0]

    def forward_batch(self, seqs: list[tuple], exact: bool = False,
                      features: list | None = None) -> list[torch.Tensor]:
        """Several sequences in one pass: `seqs` holds forward's (tokens, start,
        k_cache, v_cache, num_logits) per sequence. The linear layers run on all
        rows at once (weights read once); attention runs per sequence over its
        own cache. With exact=True every row rounds as in a call of its own.
        With `features` (a list) and cfg.feature_layers set, one float32 tensor
        per sequence is appended to it: the outputs of those decoder layers for
        every one of its rows, [n, len(feature_layers) * hidden], concatenated in
        the layers' order (the residual stream after the layer, before the final
        norm). Capturing them changes no other result."""
        exact = exact and self._exact_mm is not None
        mm = self._exact_mm if exact else F.linear
        x = F.embedding(torch.cat([s[0] for s in seqs]) if len(seqs) > 1 else seqs[0][0],
                        self.w["model.embed_tokens.weight"])
        segs, off = [], 0
        for tokens, start, k_cache, v_cache, num_logits in seqs:
            n = tokens.shape[0]
            # no mask: attention row by row
            segs.append(_Segment(off, n, start, k_cache, v_cache, num_logits, None if exact else self._mask(start, n)))
            off += n
        ropes = [self._rope(s.start, s.n) for s in segs]
        rope = tuple(torch.cat(parts) if len(parts) > 1 else parts[0] for parts in zip(*ropes))
        wanted = self.cfg.feature_layers if features is not None else ()
        captured = {}
        for i in range(self.cfg.num_layers):
            x = self._layer(i, x, segs, rope, mm)
            if i in wanted:
                captured[i] = x
        if wanted:
            feats = torch.cat([captured[i] for i in wanted], dim=-1).float()
            features.extend(feats.split([s.n for s in segs]))
        rows = [x[s.off + s.n - s.num_logits:s.off + s.n] for s in segs]
        h = self._norm(torch.cat(rows) if len(rows) > 1 else rows[0], self.w["model.norm.weight"])
        return list(mm(h, self.lm_head).float().split([s.num_logits for s in segs]))

    def _layer(self, i, x, segs, rope, mm):
        cfg, p, (cos, sin) = self.cfg, f"model.layers.{i}.", rope
        n = x.shape[0]
        h = self._norm(x, self.w[p + "input_layernorm.weight"])
        q = self._linear(mm, h, p + "self_attn.q_proj", cfg.attention_bias)
        k = self._linear(mm, h, p + "self_attn.k_proj", cfg.attention_bias)
        v = self._linear(mm, h, p + "self_attn.v_proj", cfg.attention_bias)
        q = q.view(n, cfg.num_heads, cfg.head_dim).transpose(0, 1)
        k = k.view(n, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        v = v.view(n, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)
        atts = []
        for s in segs:
            rows = slice(s.off, s.off + s.n)
            k_cache, v_cache = s.k_cache[i], s.v_cache[i]
            k_cache[:, s.start:s.start + s.n] = k[:, rows]
            v_cache[:, s.start:s.start + s.n] = v[:, rows]
            atts.append(self._attend(q[:, rows], k_cache, v_cache, s.start, s.mask))
        att = torch.cat(atts, dim=1) if len(atts) > 1 else atts[0]
        x = x + self._linear(mm, att.transpose(0, 1).reshape(n, -1), p + "self_attn.o_proj")
        h = self._norm(x, self.w[p + "post_attention_layernorm.weight"])
        gate = F.silu(self._linear(mm, h, p + "mlp.gate_proj"))
        return x + self._linear(mm, gate * self._linear(mm, h, p + "mlp.up_proj"), p + "mlp.down_proj")


@dataclass
class _Segment:
    """One sequence's rows [off, off+n) of a batched pass, at positions [start, start+n)."""
    off: int
    n: int
    start: int
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    num_logits: int
    mask: torch.Tensor | None
