"""What `hetero-sd train-head` trains with (no torch import: the CLI reads the defaults)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainOptions:
    prompts: int = 120  # self-distillation prompts (templates first, then docstring tasks)
    max_new_tokens: int = 160  # per response
    source_chunks: int = 60  # teacher-forced chunks of standard-library source
    seq_len: int = 256  # training sequence length (longer sequences are cut)
    draft_vocab: int = 4096
    aux_layers: tuple[int, ...] | None = None  # EAGLE-3 ids; None: (2, L // 2, L - 3)
    ttt_steps: int = 3
    batch: int = 2
    # Train the LM head too? Off: it stays the target's own (restricted to the draft
    # vocabulary), so the layer learns to land in the target's output space: fewer
    # weights to learn from a CPU-sized dataset, and a third less backward work.
    train_lm_head: bool = False
    lr: float = 1e-3
    minutes: float = 20.0  # training time (data preparation not counted) ...
    steps: int | None = None  # ... or exactly this many steps (reproducible whatever the host's load)
    save_every: int = 50
    seed: int = 0
