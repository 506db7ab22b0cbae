"""Hardware-neutral hyper-parameters of a decoder-only model."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class MoEConfig:
    """Sparse mixture-of-experts blocks (Qwen3-MoE, Mixtral): each row's router
    picks `experts_per_token` of `num_experts` gated MLPs of width
    `intermediate_size`; their outputs are summed in expert-index order,
    weighted by the router's softmax probabilities (renormalised over the
    chosen ones when `normalize_topk`). Layers not in `layers` keep the dense MLP."""
    num_experts: int
    experts_per_token: int
    intermediate_size: int
    normalize_topk: bool
    layers: tuple[int, ...]


@dataclass(frozen=True)
class ModelConfig:
    family: str  # key into ir.families, e.g. "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    rope_scaling: dict | None = None  # HF-style dict with "rope_type"; None = plain RoPE
    rope_freq_factors: tuple[float, ...] | None = None  # llama.cpp's rope_freqs (llama3 GGUF)
    sliding_window: int | None = None  # attend to at most this many previous positions
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # The LM head scores only token ids < output_vocab (a draft's cheaper head,
    # as EAGLE-3 drafts over a reduced vocabulary); None: all of vocab_size.
    output_vocab: int | None = None
    # Decoder layers whose outputs the forward also returns, per input row (an
    # EAGLE-3 draft head fuses a low, mid and high layer): index i is the
    # residual stream after layer i (0-based), before the final norm. (): none.
    feature_layers: tuple[int, ...] = ()
    # ---- what families differ in (the defaults are Llama's) ----
    qk_norm: bool = False  # RMSNorm over each head's q and k before RoPE (Qwen3, Gemma 3)
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" | "gelu_tanh" (Gemma)
    # Gemma's four norms per layer: the attention and MLP outputs are normed
    # before their residual adds (post_attention / post_feedforward), and the
    # MLP's input by pre_feedforward_layernorm.
    sandwich_norms: bool = False
    embed_scale: float | None = None  # the embedding rows times this (Gemma: sqrt(hidden))
    query_scale: float | None = None  # attention's score scale; None: head_dim ** -0.5
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2 style)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    # Per-layer attention window (None for a global layer); None: sliding_window on every layer.
    layer_windows: tuple[int | None, ...] | None = None
    local_rope_theta: float | None = None  # RoPE base of windowed layers, unscaled (Gemma 3)
    nope_layers: tuple[int, ...] = ()  # layers without RoPE (SmolLM3)
    rotary_dim: int | None = None  # RoPE on the first rotary_dim of each head (Phi-4-mini); None: all
    fused_qkv: bool = False  # one self_attn.qkv_proj weight, q then k then v rows (Phi-3)
    fused_gate_up: bool = False  # one mlp.gate_up_proj weight, gate then up rows (Phi-3)
    moe: MoEConfig | None = None

    @property
    def logits_vocab(self) -> int:
        """Width of the logits the model produces."""
        return self.output_vocab or self.vocab_size

    def window(self, layer: int) -> int | None:
        """How many previous positions (itself included) layer `layer` attends to; None: all."""
        return self.layer_windows[layer] if self.layer_windows is not None else self.sliding_window

    @property
    def windows(self) -> tuple[int | None, ...]:
        """The distinct windows of the layers, in first-use order."""
        return tuple(dict.fromkeys(self.window(i) for i in range(self.num_layers)))

    def uses_rope(self, layer: int) -> bool:
        return layer not in self.nope_layers

    def local_rope(self, layer: int) -> bool:
        """Whether layer `layer` takes the windowed layers' own RoPE (local_rope_theta)."""
        return self.local_rope_theta is not None and self.window(layer) is not None

    def sparse(self, layer: int) -> bool:
        return self.moe is not None and layer in self.moe.layers

    @property
    def attention_scale(self) -> float:
        return self.query_scale if self.query_scale is not None else self.head_dim ** -0.5

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV-cache footprint of one position, all layers, K and V."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes
