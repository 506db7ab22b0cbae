"""Hardware-neutral hyper-parameters of a decoder-only model."""
from __future__ import annotations

from dataclasses import dataclass, field, replace


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

    @property
    def logits_vocab(self) -> int:
        """Width of the logits the model produces."""
        return self.output_vocab or self.vocab_size

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV-cache footprint of one position, all layers, K and V."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def with_layers(self, num_layers: int) -> "ModelConfig":
        return replace(self, num_layers=num_layers)
