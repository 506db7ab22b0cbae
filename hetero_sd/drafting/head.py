"""Drafting with an EAGLE-3 head (eagle.py) from the target's hidden states.

The engine hands the target's features for the rows it committed with each
DraftRequest (ir.work.DraftRequest.features). The head keeps its own KV cache
over the pairs (target hidden state at j, token j + 1), one pair per committed
position whose next token is known; a draft extends it with the new pairs in
one call, then drafts token by token from its own outputs. Rows written while
drafting are overwritten by the next request's real pairs: rollback is a
length change, as in a runner's pool.

Sampling stays lossless: the head's draft-vocabulary logits are scattered into
the full target vocabulary (-inf elsewhere) before the sampler warps and draws
them, so q is exactly the distribution the draft came from, zero outside the
draft vocabulary, over the target's own token ids.
"""
from __future__ import annotations

import copy
import time
from contextlib import nullcontext

import numpy as np

from hetero_sd.drafting.base import Drafter, round_of
from hetero_sd.ir.errors import ConfigError
from hetero_sd.ir.work import DraftRequest, DraftResult
from hetero_sd.scheduler.round import Round


class HeadDrafter(Drafter):
    name = "head"
    can_fork = True

    def __init__(self, runner, target_vocab: int):
        """`runner`: a head runner (backends/torch_head.py states the contract)."""
        if runner.vocab_size != target_vocab:
            raise ConfigError(f"draft head has a vocabulary of {runner.vocab_size} tokens but the target "
                              f"has {target_vocab}: the head was trained for another model")
        self.runner, self.target_vocab = runner, target_vocab
        self.feature_layers = runner.feature_layers  # what the target must return (ModelSpec.features)
        self._ids = runner.target_ids  # draft id -> target id
        self._ready = False
        self.reset()

    def fork(self) -> "HeadDrafter":
        """An independent drafter for another concurrent sequence, sharing the head's weights."""
        clone = copy.copy(self)  # (drafters are constructed in drafting.build alone)
        clone.runner, clone._ready = self.runner.fork(), False
        clone.reset()
        return clone

    def begin(self, capacity: int, sampler=None, guide=None) -> None:
        self.reset()
        self.runner.begin(capacity)
        self._ready = True
        self._sampler, self._guide = sampler, guide

    def reset(self) -> None:
        self.forget_context()
        self.pairs = 0  # pairs 0..pairs-1 hold real features in the cache
        self.first = 0  # the first of them (later than 0 after a gap in the features)
        self._last = None  # (pre-norm output, logits) of pair `pairs - 1`: the first draft comes from it
        self._pending, self._pending_at = None, 0  # features not yet run, from position _pending_at
        self._drafted = 0  # drafts the last draft call proposed (0: a round another drafter served)
        self._sampler = self._guide = None

    def draft(self, req: DraftRequest, rnd: Round | None = None) -> DraftResult:
        """Drafts up to req.k tokens; k = 0 only takes in the context and features (a hybrid
        drafter's round that another drafter serves): they run with the next real draft."""
        if not self._ready:
            raise RuntimeError("HeadDrafter.begin must be called before draft")
        ctx = self.context_for(req)
        kept = max(req.base_len - 1, 0)  # pair j stays valid while token j + 1 is unchanged
        if kept < self.pairs:
            self.pairs, self._last = kept, None
            self.first = min(self.first, kept)  # (rolled back past a gap's start: nothing cached is left)
        n = len(ctx)
        self._stash(req.features, kept, n)
        if req.k < 1:
            self._drafted = 0
            return DraftResult(req.seq_id, [])
        # more pending pairs than its own drafts and a bonus: committed text the head did not
        # draft (a copy, rounds without drafts), a one-off that does not price draft steps
        behind = self._pending is not None and len(self._pending) > self._drafted + 1
        t0 = time.perf_counter()
        self._extend(ctx)
        catch_up_s = time.perf_counter() - t0 if behind else 0.0
        if self._last is None or self.pairs != n - 1:
            self._drafted = 0
            return DraftResult(req.seq_id, [])  # no features for the newest position: nothing to draft from
        result = self._draft(req.seq_id, req.k, n - 1)
        self._drafted = len(result.tokens)
        round_of(rnd).catch_up_s = catch_up_s
        return result

    def _stash(self, features, kept: int, n: int) -> None:
        """Keep features (those of the positions just before the newest tokens) until a draft runs them."""
        if self._pending is not None and self._pending_at + len(self._pending) > kept:  # rolled back
            self._pending = self._pending[:max(kept - self._pending_at, 0)]
        if features is None or not len(features):
            return
        rows = np.asarray(features, dtype=np.float32)
        start = n - 1 - len(rows)
        if self._pending is not None and len(self._pending) and self._pending_at + len(self._pending) == start:
            self._pending = np.concatenate([self._pending, rows])
        else:
            self._pending, self._pending_at = rows, start

    def _extend(self, ctx) -> None:
        """Run the pending pairs through the head, in one call, writing their KV."""
        if self._pending is None or not len(self._pending):
            return
        rows, start = self._pending, self._pending_at
        self._pending = None
        if start > self.pairs:  # a gap (a failover restarted the features): attend from here on
            self.first = self.pairs = start
        rows = rows[self.pairs - start:]
        if not len(rows):
            return
        p = self.pairs
        self._last = self.runner.run(list(ctx[p + 1:p + 1 + len(rows)]), p, self.first, features=rows)
        self.pairs = p + len(rows)

    def _draft(self, seq_id: int, k: int, pos: int) -> DraftResult:
        (h, logits), out, probs = self._last, [], []
        with self._guide.walking() if self._guide is not None else nullcontext() as step:
            for i in range(k):
                token, q = self._choose(logits)
                if token is None:
                    break
                out.append(token)
                if q is not None:
                    probs.append(q)
                if step is not None:
                    step(token)
                    if self._guide.finished:
                        break
                if i + 1 < k:  # feed (own output, the draft) at the next position
                    h, logits = self.runner.run([token], pos + i, self.first, hidden=h)
        return DraftResult(seq_id, out, np.stack(probs) if probs else None)

    def _choose(self, logits: np.ndarray):
        """(target token, q over the target vocabulary or None when greedy); (None, None)
        when the grammar allows nothing in the draft vocabulary."""
        if self._guide is not None:
            allowed = self._guide.allowed()[:self.target_vocab][self._ids]
            if not allowed.any():
                return None, None
            logits = np.where(allowed, logits, -np.inf)
        if self._sampler is None:
            return int(self._ids[int(logits.argmax())]), None
        full = np.full((1, self.target_vocab), -np.inf, dtype=np.float32)
        full[0, self._ids] = logits  # scattered: q is zero outside the draft vocabulary
        token, q = self._sampler.sample_draft(full)
        if not np.isfinite(q).all():
            raise FloatingPointError("head: the draft distribution is not finite")
        return int(token), q
