"""Prompt lookup: draft what followed the latest earlier occurrence of the last n tokens."""
from __future__ import annotations

import copy
from collections import deque

from hetero_sd.drafting.base import Drafter
from hetero_sd.ir.errors import ConfigError
from hetero_sd.ir.work import MAX_DRAFT_TOKENS, DraftRequest, DraftResult

UNDO = 4 * (MAX_DRAFT_TOKENS + 1)  # logged positions: a pre-draft's rollback is at most 2 rounds' drafts


class NgramDrafter(Drafter):
    """Find the latest earlier occurrence of the last n tokens (n from
    max_ngram down to min_ngram) and propose what followed it.

    The index is incremental: each committed token adds one entry per n, so a
    lookup is O(max_ngram) whatever the context length. The writes of the last
    UNDO positions are logged, so a rollback past tokens a pre-draft was told
    (hetero_sd/ahead.py) undoes them instead of rebuilding the index.
    """

    name = "ngram"  # deterministic proposals: under sampling its q is one-hot (probs=None)
    model_free = True
    one_hot = True  # deterministic proposals: probs None under sampling
    can_fork = True

    def __init__(self, min_ngram: int = 2, max_ngram: int = 4):
        if not 1 <= min_ngram <= max_ngram:
            raise ConfigError(f"n-gram sizes need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.reset()

    def fork(self) -> "NgramDrafter":
        """An independent drafter for another concurrent sequence (the batching server)."""
        clone = copy.copy(self)  # (drafters are constructed in drafting.build alone)
        clone.reset()  # a fresh context and index of its own
        return clone

    def begin(self, capacity: int, sampler=None, guide=None) -> None:
        self.reset()
        self._guide = guide

    def reset(self) -> None:
        self.forget_context()
        self._indexed = 0  # positions e < _indexed have their preceding n-grams indexed
        self._index: dict[int, dict[tuple, int]] = {n: {} for n in range(self.min_ngram, self.max_ngram + 1)}
        self._undo: deque[tuple[int, int, tuple, int | None]] = deque()  # (e, n, key, the entry before)
        self._guide = None

    def _update_index(self, ctx) -> None:
        # Entry (n-gram ending at e-1) -> e, the position of the token after it.
        for e in range(max(self._indexed, 1), len(ctx)):
            for n, table in self._index.items():
                if e >= n:
                    key = tuple(ctx[e - n:e])
                    self._undo.append((e, n, key, table.get(key)))
                    table[key] = e
        self._indexed = max(self._indexed, len(ctx))
        while self._undo and self._undo[0][0] < self._indexed - UNDO:
            self._undo.popleft()

    def _roll_back(self, length: int) -> None:
        """Forget the entries of positions >= length: undone where logged, else rebuilt."""
        if self._indexed - length > UNDO or (self._undo and self._undo[0][0] > length):
            self._indexed, self._undo = 0, deque()
            self._index = {n: {} for n in self._index}
            return
        while self._undo and self._undo[-1][0] >= length:
            _, n, key, before = self._undo.pop()
            if before is None:
                del self._index[n][key]
            else:
                self._index[n][key] = before
        self._indexed = length

    def draft(self, req: DraftRequest, rnd=None) -> DraftResult:
        ctx = self.context_for(req)
        if req.base_len < self._indexed:  # rolled back past indexed tokens
            self._roll_back(req.base_len)
        self._update_index(ctx)
        best, best_valid = [], -1
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(ctx) < n:
                continue
            e = self._index[n].get(tuple(ctx[-n:]))
            if e is None:
                continue
            proposal = ctx[e:e + req.k]
            if self._guide is None:  # the longest match wins
                return DraftResult(req.seq_id, proposal)
            # Under a grammar: the match whose continuation the grammar allows
            # furthest (longer n first on a tie). Still a function of the context
            # alone, so its q stays one-hot and sampling exact.
            valid = self._guide.valid_prefix(proposal)
            if valid > best_valid:
                best, best_valid = proposal, valid
            if valid == len(proposal):
                break
        return DraftResult(req.seq_id, best)
