"""What `hetero-sd train-head` trains with (no torch import: the CLI reads the defaults)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainOptions:
    # Self-distillation: the target's greedy responses to instruction prompts (the templates
    # first, then tasks over docstrings), generated `gen_batch` at a time.
    prompts: int = 740
    max_new_tokens: int = 256  # per response
    gen_batch: int = 64
    # Teacher-forced text found on this machine (training/corpus.py), in characters
    # (about 4 per token): with the defaults the data is over a million tokens.
    text_chars: int = 3_600_000
    source_chunks: int = 0  # extra chunks of standard-library source, `seq_len` tokens each (tests)
    seq_len: int = 512  # longest stored sequence (longer ones are cut into pieces)
    window: int = 256  # training rows per sequence per step
    draft_vocab: int = 4096
    aux_layers: tuple[int, ...] | None = None  # EAGLE-3 ids; None: (2, L // 2, L - 3)
    ttt_steps: int = 3
    batch: int = 8
    # Train the LM head too? Off: it stays the target's own (restricted to the draft
    # vocabulary), so the layer learns to land in the target's output space: fewer
    # weights to learn from a CPU-sized dataset, and a third less backward work.
    train_lm_head: bool = False
    lr: float = 1e-3
    minutes: float = 30.0  # training time (data preparation not counted) ...
    steps: int | None = None  # ... or exactly this many steps (reproducible whatever the host's load)
    # Then the serving target's own states over the responses, and this much training on them
    # at a third of the learning rate (0 and None: no such stage).
    tune_minutes: float = 10.0
    tune_steps: int | None = None
    # The data's and the training's number format: auto is bf16 where the CPU computes it
    # natively (AMX, AVX-512 BF16), else fp32.
    dtype: str = "auto"  # auto | bf16 | fp32
    save_every: int = 50
    seed: int = 0
