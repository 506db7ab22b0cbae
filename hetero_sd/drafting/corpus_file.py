"""A suffix corpus on disk: a target's earlier outputs, token ids, for the
suffix drafter's global tree (drafter.suffix_corpus; built by `hetero-sd
build-corpus`, hetero_sd/training/corpus_build.py).

One safetensors file: `tokens` (uint32, every sequence end to end) and
`offsets` (int64, n + 1 bounds), and in its metadata the format, the target's
vocabulary size (checked against the target it drafts for: a corpus of another
tokenizer would only draft nonsense) and what built it.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from hetero_sd.ir.errors import ConfigError

FORMAT = "hetero-sd suffix corpus 1"


def save_corpus(path: str | Path, sequences: Sequence[Sequence[int]], vocab_size: int, **meta: str) -> Path:
    """Write `sequences` (each a prompt tail and its output) to `path`, atomically."""
    from safetensors.numpy import save_file

    path = Path(path)
    lengths = np.fromiter((len(s) for s in sequences), dtype=np.int64, count=len(sequences))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.fromiter((t for s in sequences for t in s), dtype=np.int64, count=int(offsets[-1]))
    if tokens.size and not 0 <= int(tokens.min()) <= int(tokens.max()) < vocab_size:
        raise ValueError(f"corpus token ids must lie in 0..{vocab_size - 1}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file({"tokens": tokens.astype(np.uint32), "offsets": offsets}, str(tmp),
              metadata={"format": FORMAT, "vocab_size": str(vocab_size), **{k: str(v) for k, v in meta.items()}})
    tmp.replace(path)
    return path


def corpus_info(path: str | Path) -> dict[str, str]:
    """The corpus file's metadata; a ConfigError where the file is missing or not a corpus."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"suffix corpus {path} does not exist (build one with `hetero-sd build-corpus`)")
    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = dict(f.metadata() or {})
    except Exception as exc:  # safetensors raises its own error types for a damaged header
        raise ConfigError(f"suffix corpus {path} is not a safetensors file: {exc}") from None
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{path} is not a suffix corpus (its format is {meta.get('format')!r}, "
                          f"expected {FORMAT!r})")
    return meta


def load_corpus(path: str | Path, vocab_size: int) -> list[list[int]]:
    """The corpus's sequences, checked to be for a target of `vocab_size` tokens."""
    from safetensors.numpy import load_file

    meta = corpus_info(path)
    if meta.get("vocab_size") != str(vocab_size):
        raise ConfigError(f"suffix corpus {path} was built for a vocabulary of {meta.get('vocab_size')} tokens "
                          f"(model {meta.get('model', '?')}), but the target has {vocab_size}: set "
                          "drafter.suffix_corpus to none, or build one for this target with `hetero-sd "
                          "build-corpus --config <this yaml>`")
    arrays = load_file(str(path))
    tokens, offsets = arrays.get("tokens"), arrays.get("offsets")
    if (tokens is None or offsets is None or tokens.dtype != np.uint32 or offsets.dtype != np.int64
            or tokens.ndim != 1 or offsets.ndim != 1 or offsets.size == 0 or offsets[0] != 0
            or offsets[-1] != tokens.size or np.any(np.diff(offsets) < 0)
            or (tokens.size and int(tokens.max()) >= vocab_size)):
        raise ConfigError(f"suffix corpus {path} is damaged: its tokens and offsets do not fit together "
                          "(rebuild it with `hetero-sd build-corpus`, or set drafter.suffix_corpus: none)")
    ids = tokens.astype(np.int64).tolist()
    return [ids[a:b] for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]
