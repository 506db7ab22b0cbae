"""Drafters: who proposes the tokens the target verifies.

Both keep their own view of the committed sequence, synchronised by deltas
(`DraftRequest.base_len` + `new_tokens`), so the same protocol works when a
drafter later runs in another process.

Cache off-by-one, written down: after a round the draft model's cache holds
the tokens it was fed, i.e. the context up to the last committed token minus
one, plus the drafts d1..d(k-1) (dk was sampled, never fed). The target then
commits the accepted drafts and a bonus token, so the draft cache is either
ahead (rejected drafts: truncate them) or behind by up to two tokens (dk and
the bonus: feed them). `ModelDrafter._sync` handles both by keeping the
longest common prefix of what is cached and what is committed.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

from hetero_sd.backends.base import Runner
from hetero_sd.ir.errors import ConfigError
from hetero_sd.ir.work import DraftRequest, DraftResult
from hetero_sd.sampling import Sampler


class Drafter(Protocol):
    name: str

    def begin(self, capacity: int, sampler: Sampler | None = None) -> None:
        """Start a sequence of at most `capacity` positions (reserve what it needs).
        `sampler` is None for greedy requests; a drafter that samples draws from
        its draft stream and returns the distributions in DraftResult.probs."""

    def draft(self, req: DraftRequest) -> DraftResult: ...

    def reset(self) -> None:
        """Forget the current sequence (called at the end of a request)."""


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix: how much of a cache still matches a context."""
    n, limit = 0, min(len(a), len(b))
    while n < limit and a[n] == b[n]:
        n += 1
    return n


def _apply(context: list[int], req: DraftRequest) -> list[int]:
    if req.base_len > len(context):
        raise ValueError(f"draft request base_len {req.base_len} beyond known {len(context)} tokens")
    del context[req.base_len:]
    context.extend(req.new_tokens)
    return context


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the last n tokens
    (n from max_ngram down to min_ngram) and propose what followed it.

    The index is incremental: each committed token adds one entry per n, so a
    lookup is O(max_ngram) whatever the context length.
    """

    name = "ngram"  # deterministic proposals: under sampling its q is one-hot (probs=None)

    def __init__(self, min_ngram: int = 2, max_ngram: int = 4):
        if not 1 <= min_ngram <= max_ngram:
            raise ConfigError(f"n-gram sizes need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.reset()

    def begin(self, capacity: int, sampler: Sampler | None = None) -> None:
        self.reset()

    def reset(self) -> None:
        self.context: list[int] = []
        self._indexed = 0  # positions e < _indexed have their preceding n-grams indexed
        self._index: dict[int, dict[tuple, int]] = {n: {} for n in range(self.min_ngram, self.max_ngram + 1)}

    def _update_index(self) -> None:
        ctx = self.context
        # Entry (n-gram ending at e-1) -> e, the position of the token after it.
        for e in range(max(self._indexed, 1), len(ctx)):
            for n, table in self._index.items():
                if e >= n:
                    table[tuple(ctx[e - n:e])] = e
        self._indexed = max(self._indexed, len(ctx))

    def draft(self, req: DraftRequest) -> DraftResult:
        if req.base_len < self._indexed:  # rolled back past indexed tokens: rebuild
            context = _apply(self.context, req)
            self.reset()
            self.context = context
        else:
            _apply(self.context, req)
        self._update_index()
        ctx = self.context
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(ctx) < n:
                continue
            e = self._index[n].get(tuple(ctx[-n:]))
            if e is not None:
                return DraftResult(req.seq_id, ctx[e:e + req.k])
        return DraftResult(req.seq_id, [])


class ModelDrafter:
    """A smaller (or cheaper-precision) model on any backend: greedy drafts, or
    sampled ones (with their distributions q) when the request samples."""

    name = "model"

    def __init__(self, runner: Runner, target_vocab: int, draft_desc: str = "draft model"):
        if runner.vocab_size != target_vocab:
            raise ConfigError(
                f"{draft_desc} has a vocabulary of {runner.vocab_size} tokens but the target has "
                f"{target_vocab}; draft and target must share a tokenizer")
        self.runner = runner
        self._seq: int | None = None
        self.context: list[int] = []
        self._cached: list[int] = []  # tokens whose KV the draft cache holds, in order
        self._sampler: Sampler | None = None

    def reset(self) -> None:
        if self._seq is not None:
            self.runner.release(self._seq)
        self._seq, self.context, self._cached, self._sampler = None, [], [], None

    def begin(self, capacity: int, sampler: Sampler | None = None) -> None:
        self.reset()
        self._seq = self.runner.allocate(capacity)
        self._sampler = sampler

    def _sync(self) -> list[int]:
        """Truncate the cache to the common prefix; return the tokens still to feed."""
        # always feed >= 1 token to get logits
        common = min(common_prefix(self._cached, self.context), len(self.context) - 1)
        self.runner.truncate(self._seq, common)
        del self._cached[common:]
        return self.context[common:]

    def draft(self, req: DraftRequest) -> DraftResult:
        _apply(self.context, req)
        if self._seq is None:
            raise RuntimeError("ModelDrafter.begin must be called before draft")
        feed, out, probs = self._sync(), [], []
        for _ in range(req.k):
            start = len(self._cached)
            if self._sampler is None:
                token = self.runner.greedy(self._seq, feed, start, 1)[0]
            else:
                token, q = self._sampler.sample_draft(self.runner.forward(self._seq, feed, start, 1))
                probs.append(q)
            self._cached.extend(feed)
            out.append(token)
            feed = [token]
        return DraftResult(req.seq_id, out, np.stack(probs) if probs else None)
