"""A constraint inside the speculative round: which drafts to verify, the mask
of every verified row, and what the committed tokens do to the grammar.

Constrained target-only decoding masks the target's row at every position
with the grammar state after the tokens before it, then takes the argmax or
warps and samples. Speculation keeps exactly that:

- Drafts are cut where the grammar refuses one. Greedy, or a deterministic
  drafter (q one-hot): at the first refused draft, which could never be
  accepted. A sampled draft with its own q (a drafter that did not apply the
  grammar): just after it. Its target probability is 0, so the rejection
  step rejects it with certainty and draws the correction from
  norm(max(0, p - q)), which is what keeps sampling exact; cutting it away
  instead would draw from p whenever q strayed, a different distribution.
- A deterministic proposal that stops short of k (no n-gram match, or a
  cut) is extended with the tokens the grammar forces next: free drafts.
- Row i of the verify is masked with the state after drafts[:i]. The masks
  are computed on a helper thread while the target runs its forward
  (llguidance releases the GIL), so only what outlasts the forward is on the
  critical path (`stats.mask_wait_s`; `stats.mask_s` is the whole cost).
- Only committed tokens advance the grammar; a draft walk is rolled back.
  When the language ends (nothing but EOS may follow), generation stops
  right after that token with finish_reason "grammar", in both modes.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np

from hetero_sd.constraint.guide import Guide, mask_logits
from hetero_sd.ir.errors import GenerationError

_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hsd-grammar")


class Constrainer:
    """The engine's side of one constrained request.

    Costs: stats.mask_s is all grammar work (masks on the helper thread, and the
    draft checks, forced drafts, commits and mask application on the engine's);
    stats.mask_wait_s is what of it sat on the critical path (the engine's own
    grammar work, plus waiting for masks that outlasted the forward)."""

    def __init__(self, guide: Guide, eos_ids: set[int], stats, model_vocab: int):
        self.guide, self.eos_ids, self.stats = guide, eos_ids, stats
        self.model_vocab = model_vocab  # ids past the target's head (a wider tokenizer's) are never drafted
        self._masks = None  # a Future of bool [rows, V] for the next scored rows
        self._walk: tuple[tuple, list[int]] = ((), [])  # (drafts cut() returned, how far masks can walk)
        stats.constraint = guide.constraint.describe()

    @contextmanager
    def _engine_side(self):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - t0
            self.stats.mask_s += spent
            self.stats.mask_wait_s += spent

    def cut(self, drafts: list[int], probs, k: int):
        """The drafts worth verifying (and their q rows), up to k: a deterministic
        proposal that stops short is extended with the tokens the grammar forces
        next (a schema's keys, the punctuation between them), which the target's
        masked argmax almost always takes."""
        with self._engine_side():
            valid = self.guide.valid_prefix(drafts)
            keep = valid + (1 if probs is not None and valid < len(drafts) else 0)
            if keep < len(drafts):
                self.stats.grammar_cut += len(drafts) - keep
            drafts, probs = drafts[:keep], None if probs is None else probs[:keep]
            walk = self._walkable(drafts, valid)
            if probs is None and len(walk) == len(drafts) < k:
                # a deterministic drafter's q is one-hot whatever it proposes: still exact
                forced = self.guide.forced(after=drafts)[:k - len(drafts)]
                forced = forced[:next((i for i, t in enumerate(forced) if t >= self.model_vocab), len(forced))]
                self.stats.grammar_drafted += len(forced)
                drafts, walk = drafts + forced, walk + forced
            self._walk = (tuple(drafts), walk)
        return drafts, probs

    def _walkable(self, drafts: list[int], valid: int) -> list[int]:
        """How far the grammar state can walk the drafts: not past a refused one (the
        row after it is never used: that draft is rejected), nor past an EOS (the
        output ends there)."""
        walk = drafts[:valid]
        return walk[:next((i for i, t in enumerate(walk) if t in self.eos_ids), len(walk))]

    def prepare(self, drafts: list[int]) -> None:
        """Start the masks of the len(drafts) + 1 rows the next verify scores."""
        cut_drafts, walk = self._walk
        if tuple(drafts) != cut_drafts:  # not from cut() (the prefill's empty window)
            with self._engine_side():
                walk = self._walkable(drafts, self.guide.valid_prefix(drafts))
        self._masks = _POOL.submit(self._rows, len(drafts) + 1, walk)

    def _rows(self, n: int, walk: list[int]) -> np.ndarray:
        t0 = time.perf_counter()
        rows = self.guide.allowed_rows(len(walk) + 1, walk)
        if n > len(rows):  # rows past a refused draft or an EOS: never decide anything
            rows = np.concatenate([rows, np.repeat(rows[-1:], n - len(rows), axis=0)])
        self.stats.mask_s += time.perf_counter() - t0
        return rows

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """The target's logits [n, V] with the prepared masks applied."""
        t0 = time.perf_counter()
        masks, self._masks, self._walk = self._masks.result(), None, ((), [])
        self.stats.mask_wait_s += time.perf_counter() - t0
        with self._engine_side():
            return mask_logits(logits, masks[-len(logits):])

    def commit(self, token: int) -> bool:
        """Advance the grammar by a committed token; True when its language ended."""
        with self._engine_side():
            if not self.guide.accept(token):
                raise GenerationError(f"internal: the grammar refused committed token {token}")
            return self.guide.finished

    def close(self) -> None:
        if self._masks is not None:  # an error between prepare and apply: let the helper finish
            self._masks.exception()
            self._masks = None
