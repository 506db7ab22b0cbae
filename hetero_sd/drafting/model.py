"""A draft model: a smaller (or cheaper-precision) model on any backend.

Cache off-by-one, written down: after a round the draft model's cache holds
the tokens it was fed, i.e. the context up to the last committed token minus
one, plus the drafts d1..d(k-1) (dk was sampled, never fed). The target then
commits the accepted drafts and a bonus token, so the draft cache is either
ahead (rejected drafts: truncate them) or behind by up to two tokens (dk and
the bonus: feed them). `sync_cache` handles both by keeping the
longest common prefix of what is cached and what is committed.
"""
from __future__ import annotations

import copy
import time
from contextlib import nullcontext

import numpy as np

from hetero_sd.backends.base import Runner
from hetero_sd.drafting.base import Drafter, common_prefix, round_of
from hetero_sd.ir.errors import ConfigError
from hetero_sd.ir.work import DraftRequest, DraftResult
from hetero_sd.scheduler.round import Round


class ModelDrafter(Drafter):
    """Greedy drafts, or sampled ones (with their distributions q) when the request samples."""

    name = "model"
    can_fork = True

    def __init__(self, runner: Runner, target_vocab: int, draft_desc: str = "draft model",
                 head_vocab: int | None = None, min_prob: float | None = 0.0):
        check_vocab(runner, target_vocab, draft_desc, head_vocab)
        self.runner, self.target_vocab, self.min_prob = runner, target_vocab, min_prob
        self._seq: int | None = None
        self._cached: list[int] = []  # tokens whose KV the draft cache holds, in order
        self._sampler = None

    def fork(self) -> "ModelDrafter":
        """An independent drafter for another concurrent sequence, sharing the draft
        runner (each holds its own sequence in the runner's pool)."""
        clone = copy.copy(self)  # (drafters are constructed in drafting.build alone)
        clone._seq = None  # the original's sequence stays the original's
        clone.reset()
        return clone

    def reset(self) -> None:
        if self._seq is not None:
            self.runner.release(self._seq)
        self._seq, self._cached, self._sampler, self._guide = None, [], None, None
        self.forget_context()

    def begin(self, capacity: int, sampler=None, guide=None) -> None:
        self.reset()
        self._seq = self.runner.allocate(capacity)
        self._sampler, self._guide = sampler, guide

    def _sync(self, context) -> list[int]:
        return sync_cache(self.runner, self._seq, self._cached, context)

    def draft(self, req: DraftRequest, rnd: Round | None = None) -> DraftResult:
        rnd = round_of(rnd)
        context = self.context_for(req)
        if self._seq is None:
            raise RuntimeError("ModelDrafter.begin must be called before draft")
        feed, out, probs = self._sync(context), [], []
        clock = CatchUpClock(len(feed))
        # The guide is the engine's: the walk over the drafts is undone on the way out.
        with self._guide.walking() if self._guide is not None else nullcontext() as step:
            stop = DraftStop(self.min_prob, rnd)
            for i in range(req.k):
                token, q, sure = self._next(feed, stop, i)
                clock.first_call_done()
                if token is None:
                    break
                if q is not None:
                    if not np.isfinite(q).all():  # NaN logits: q would bias the rejection step
                        raise FloatingPointError(f"{self.name}: the draft model's distribution is not finite")
                    # a restricted head proposes only ids < its width: q is 0 beyond
                    # it, which the target's rejection rule handles like any q
                    probs.append(q if len(q) == self.target_vocab else np.pad(q, (0, self.target_vocab - len(q))))
                self._cached.extend(feed)
                out.append(token)
                feed = [token]
                if step is not None:
                    step(token)
                    if self._guide.finished:  # the language ended: only EOS could follow
                        break
                if not sure:  # (the stop rule: what would follow is not worth a draft step)
                    break
        rnd.catch_up_s = clock.seconds
        return DraftResult(req.seq_id, out, np.stack(probs) if probs else None)

    def _next(self, feed: list[int], stop: "DraftStop", i: int):
        """Draft i: the token, the q it was drawn from (None when greedy), and whether
        the round drafts on after it; (None, None, False) when the grammar allows nothing
        the draft's head can propose, or the stop rule does not propose a greedy draft.
        With a guide the draft's logits are masked first, so drafts stay on the
        grammar and q is the masked, renormalised distribution they came from."""
        start = len(self._cached)
        if self._guide is None:
            if self._sampler is None:
                token, prob = greedy_prob(self.runner, self._seq, feed, start, stop.needs_prob)
                propose, go_on = stop.take(i, prob)
                if not propose:  # fed, not proposed: the cache holds the feed
                    self._cached.extend(feed)
                    return None, None, False
                return token, None, go_on
            return *self._sampler.sample_draft(self.runner.forward(self._seq, feed, start, 1)), True
        from hetero_sd.constraint.guide import mask_logits

        logits = self.runner.forward(self._seq, feed, start, 1)[-1:]
        allowed = self._guide.allowed()[:logits.shape[-1]]
        if not allowed.any():  # a restricted head cannot say what the grammar needs next
            return None, None, False
        logits = mask_logits(logits, allowed)
        if self._sampler is None:
            return int(logits[0].argmax()), None, True
        return *self._sampler.sample_draft(logits), True


def sync_cache(runner: Runner, seq: int, cached: list[int], context) -> list[int]:
    """Truncate the draft's cache (and `cached`, the ids it holds) to their common prefix
    with `context`; return the tokens still to feed (at least one: logits need a row)."""
    common = min(common_prefix(cached, context), len(context) - 1)
    runner.truncate(seq, common)
    del cached[common:]
    return list(context[common:])


# A round's feed is at most 2 tokens when the drafter drafted the round before (its last
# draft and the bonus; a few more across tokenizers): a longer one holds context it did
# not draft, its prompt or a copy a hybrid's lookup served.
CATCH_UP = 4


class CatchUpClock:
    """The seconds of a round's first draft call where its feed was long (> CATCH_UP):
    Round.catch_up_s. Taking in a prompt or a long copy is a one-off; priced
    as a draft step it made a 0.5B's step look 5 times dearer, and `k: auto` then
    turned drafting off (each probe's catch-up confirming the price)."""

    def __init__(self, feed_len: int):
        self.seconds, self._t0 = 0.0, time.perf_counter() if feed_len > CATCH_UP else None

    def first_call_done(self) -> None:
        if self._t0 is not None:
            self.seconds, self._t0 = time.perf_counter() - self._t0, None


def greedy_prob(runner: Runner, seq: int, feed: list[int], start: int, want_prob: bool) -> tuple[int, float]:
    """The draft's greedy next token and the draft's probability of it (1.0 unless
    asked for: then only the ids are asked of the runner)."""
    if not want_prob:
        return runner.greedy(seq, feed, start, 1)[0], 1.0
    logits = runner.forward(seq, feed, start, 1)[-1]
    token = int(logits.argmax())
    # exp in the logits' float32, summed in float64: over the 0.5B's 152k ids a tenth
    # of a float64 pass (0.1 against 1.6 ms a draft step on 2 cores); the probability
    # only decides how far a round drafts, never which token is output
    return token, float(1.0 / np.exp(logits - logits[token]).sum(dtype=np.float64))


class DraftStop:
    """Where a round of greedy drafts from a model stops, draft by draft.

    - min_prob p (fixed): a draft whose probability under the draft model is below p
      is not proposed and ends the round, unless its verify row is free (a padded
      one-token call, Round.free_rows): then it is proposed, the round's last.
    - min_prob None (`auto`) with Round.prices: draft i is proposed while the
      chance that the target accepts it, taken as the product of the draft's
      probabilities up to it, is at least what its verify row costs (prices.rows[i],
      in decode steps) times prices.rate (the tokens a decode step's time makes
      lately: what that time is worth); the next one is drafted only while that
      chance also covers the next row and a draft step, so priced (it can only
      fall). So a cheap extra row takes an unsure draft and a dear one does not,
      by the costs the policy measures on this host, not by a constant; and the
      better speculation is going, the surer a draft must be to be worth its time.
    - Neither (min_prob 0, or auto without prices: a policy that knows no costs):
      every draft, up to k.
    """

    def __init__(self, min_prob: float | None, rnd: Round):
        self.min_prob = min_prob or 0.0
        self.prices = rnd.prices if min_prob is None else None
        self.free, self.chance = rnd.free_rows, 1.0

    @property
    def needs_prob(self) -> bool:
        return self.min_prob > 0 or self.prices is not None

    def take(self, i: int, prob: float) -> tuple[bool, bool]:
        """(propose draft i of probability prob, draft the next one)."""
        if self.prices is None:
            sure = prob >= self.min_prob
            return sure or i < self.free, sure
        rows, rate, self.chance = self.prices.rows, self.prices.rate, self.chance * prob
        propose = i < self.free or self.chance >= rate * rows[min(i, len(rows) - 1)]
        go_on = propose and self.chance >= rate * (rows[min(i + 1, len(rows) - 1)] + self.prices.step)
        return propose, go_on


def check_vocab(runner: Runner, target_vocab: int, desc: str, head_vocab: int | None = None) -> None:
    """A draft scores the target's token ids: all of them, or (a restricted
    head, `vocab:`) exactly the first head_vocab of them."""
    want = target_vocab if head_vocab is None else head_vocab
    if head_vocab is not None and head_vocab > target_vocab:
        raise ConfigError(f"{desc}: vocab {head_vocab} exceeds the target's vocabulary of {target_vocab} tokens")
    if runner.vocab_size != want:
        what = f"its vocab: key asks for {want}" if head_vocab is not None else f"the target has {want}"
        raise ConfigError(f"{desc} has a vocabulary of {runner.vocab_size} tokens but {what}; "
                          "draft and target must share a tokenizer")
