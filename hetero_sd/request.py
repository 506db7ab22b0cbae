"""One request through its phases: the public protocol everything drives.

    req = engine.request(prompt_ids, max_new_tokens=64)
    done = req.start()                    # prefill: the first token is committed
    while not done:
        step = req.propose()              # draft: the step record, None when the context is full
        if step is None:
            break
        done = req.accept(step, req.score(step))   # verify, accept, commit; rollback is a length change
    result = req.close()                  # free the sequence; text, ids and stats

`req.run()` is that loop (what `Engine.generate` calls). The batching server
(hetero_sd/serve/batch.py) drives many requests by the same phases, scoring
all their steps in one `Runner.forward_batch` over `req.batch_item(step)` and
handing each its share through `req.score_logits(logits)`.

The words (draft, step, accepted, recovered, bonus, committed, rollback,
history) are the glossary's in ir/work.py. The request owns the one token
history: the stop checker reads it, the target's failover wrapper replays
it, and drafters are given it (or sent its deltas in another process).

Where the target's device works asynchronously and the drafter's is another
(scheduler/overlap.py decides; Engine.request sets `overlap`), `run` submits
each verify and pre-drafts the next round while it runs (hetero_sd/ahead.py).

One round, greedy: the drafter proposes k tokens; the target scores the last
committed token plus the drafts in one call (k + 1 rows); the longest prefix
of drafts equal to the target's own choices is accepted, and the target's
token after it (recovered, or the bonus when all were accepted) is committed
too. Target-only decoding is the same loop with no drafts, so the two share
every line that could make them differ. Sampled, modified rejection sampling
(hetero_sd/sampling.py) replaces the comparison, so committed tokens follow
the target's distribution exactly.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from hetero_sd.ahead import PreDraft, hidden_seconds, predraft
from hetero_sd.backends.base import BatchItem, Pending
from hetero_sd.errors import GenerationError
from hetero_sd.failover import FailoverDrafter, FailoverRunner
from hetero_sd.ir.work import DraftRequest, VerifyRequest
from hetero_sd.sampling import Sampler, accept_greedy
from hetero_sd.scheduler.mode import FREE, RequestMode
from hetero_sd.scheduler.round import DraftLengthPolicy, Round
from hetero_sd.scoring import Scorer, TokenLogprob
from hetero_sd.stats import GenerationStats
from hetero_sd.stopping import StopChecker


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None  # one per token id, when asked for

    def to_dict(self) -> dict:
        out = {"text": self.text, "token_ids": self.token_ids, "stats": self.stats.to_dict()}
        if self.logprobs is not None:
            out["logprobs"] = [{"token": e.token, "logprob": e.logprob, "top": e.top} for e in self.logprobs]
        return out


class Request:
    """One request's state: its stop checker (which holds the token history), the
    target's sequence and the position the next step starts at, what the drafter has
    been told (DraftFeed), how rows are scored (Scorer), its mode and the round in
    flight. Made by Engine.request."""

    def __init__(self, target: FailoverRunner, drafter: FailoverDrafter | None, policy: DraftLengthPolicy,
                 stopper: StopChecker, stats: GenerationStats, scorer: Scorer, mode: RequestMode = FREE):
        self.target, self.drafter, self.policy, self.scorer = target, drafter, policy, scorer
        self.stopper, self.stats, self.mode = stopper, stats, mode  # (mode: scheduler/mode.py)
        self.started_at = time.perf_counter()
        self.seq = target.allocate(self.capacity, self.history)
        self.pos = 0  # positions of the target's cache the next step starts at
        # what of the history (and of the target's hidden states, for a head) the drafter was told
        self.feed = DraftFeed(drafter is not None and bool(target.feature_layers))
        # the step proposed and not yet accepted, its round (None: a target-only round) and
        # when the verify began
        self._pending: tuple[VerifyRequest, Round | None, float] | None = None
        self.overlap = None  # scheduler.overlap.OverlapDecision (Engine.request); None: serial
        self._ahead: PreDraft | None = None  # the next round's drafts, pre-drafted during the verify

    @property
    def history(self):
        """The request's one token history (TokenHistory), which its stop checker appends to."""
        return self.stopper.history

    @property
    def capacity(self) -> int:
        """Positions its target sequence holds. Drafts are capped at the tokens still wanted,
        so no verify writes past position n + budget - 2: the prompt plus the budget suffices."""
        return min(self.history.prompt_len + self.stopper.max_new_tokens, self.target.max_context)

    @property
    def sampler(self) -> Sampler | None:
        return self.scorer.sampler

    @property
    def constrainer(self):
        return self.scorer.constrainer

    @property
    def token_logprobs(self) -> list[TokenLogprob] | None:
        return self.scorer.entries

    @property
    def round(self) -> Round | None:
        """The record of the round proposed and not yet accepted (None: none, or target-only)."""
        return self._pending[1] if self._pending is not None else None

    @property
    def tokens(self) -> list[int]:
        """The output so far (committed tokens after the prompt)."""
        return self.history.output

    def constrain(self, guide, eos_ids: set[int], model_vocab: int) -> None:
        from hetero_sd.constraint.rounds import Constrainer

        self.scorer.constrainer = Constrainer(guide, eos_ids, self.stats, model_vocab)

    def run(self, cached: int = 0, after_commit: Callable[[], None] | None = None) -> None:
        """Prefill, then steps of propose, score, accept, until generation ends;
        `after_commit()` is called whenever tokens were committed and more may follow
        (a stream's moment to send text). cached: as for start."""
        if self.start(cached):
            return
        while True:
            if after_commit is not None:
                after_commit()
            step = self.propose()
            if step is None:
                return
            scored = self.verify(step)
            if self.accept(step, scored):
                return

    @property
    def overlapping(self) -> bool:
        """Whether its verifies hide the next round's drafting (a constrained request's
        grammar state is round r's while round r+1 would be drafted: it stays serial)."""
        return self.overlap is not None and self.overlap.on and self.speculating and self.constrainer is None

    def verify(self, step: VerifyRequest):
        """score(step); where the request overlaps, the target's device computes it while
        the drafter pre-drafts the next round here (hetero_sd/ahead.py)."""
        if not self.overlapping:
            return self.score(step)
        pending = self.submit(step)
        rnd, t0 = self.round, time.perf_counter()
        k = self._ahead_k(step, rnd)
        if k > 0:
            self._ahead = predraft(self.drafter, self.feed, self.seq, self.history.ids, step.drafts, k, rnd.prices)
        drafted_at = time.perf_counter()
        scored = pending.wait()
        if k > 0:
            self.stats.predraft_s += drafted_at - t0
            self.stats.hidden_draft_s += hidden_seconds(pending, t0, drafted_at)
        return scored

    def _ahead_k(self, step: VerifyRequest, rnd: Round | None) -> int:
        """Drafts to pre-draft for the round after `step`: the k this round asked for,
        within the tokens still wanted and the room left once it commits all."""
        if rnd is None or not self.drafter.active:
            return 0
        wanted = self.stopper.max_new_tokens - (self.history.output_len + len(step.drafts) + 1) - 1
        return max(0, min(rnd.asked, wanted, self.capacity - (self.pos + len(step.tokens)) - 1))

    def submit(self, step: VerifyRequest) -> Pending:
        """score(step) as a submitted call (Runner.submit): Pending.wait() returns its scores."""
        n = len(step.tokens)
        if self.scorer.plain:
            return self.target.submit(self.seq, step.tokens, step.start, n, greedy=True)
        return self.target.submit(self.seq, step.tokens, step.start, n, greedy=False).then(self.score_logits)

    # ------------------------------------------------------------ the phases
    def start(self, cached: int = 0) -> bool:
        """Begin the drafter and prefill the prompt; True when generation is already over.
        cached: leading prompt positions whose KV the target sequence already holds
        (copied from an earlier request's by a serving prefix cache)."""
        con, prompt = self.constrainer, self.history.ids
        if self.drafter is not None:
            self.drafter.begin(self.capacity, self.sampler, None if con is None else con.guide)
        if con is not None:
            con.prepare([])
        self.stats.cached_tokens = cached
        n = len(prompt)
        first = self._scored(list(prompt[cached:]), cached, 1)[0]
        self._keep_features(n - cached)
        self.pos = n
        self.stats.prefill_s = time.perf_counter() - self.started_at
        return self._commit([first if self.sampler is None else self.sampler.draw_target(first, 0)])

    @property
    def greedy(self) -> bool:
        return self.sampler is None

    @property
    def speculating(self) -> bool:
        """Whether its rounds draft (a drafter that is on)."""
        return self.drafter is not None and self.drafter.active

    def propose(self, draft: bool = True, alone: bool = True) -> VerifyRequest | None:
        """Draft, and return the step the target must score (the last committed token
        plus the drafts); None when the context is full. draft=False: a target-only
        round (a batching server's gate), which feeds no draft-length policy. alone:
        this request's step is the target's whole call (a padded one-token call's
        second row is then free: _free_row)."""
        if self.pos >= self.capacity:  # no room to score another position
            self.stopper.reason = "context"
            return None
        rnd, k = self._start_round(alone) if draft and self.speculating else (None, 0)
        drafts, draft_probs = self._draft(rnd, k) if k > 0 else ([], None)
        if rnd is not None:
            rnd.drafted = len(drafts)
        if self.constrainer is not None:
            self.constrainer.prepare(drafts)
        step = VerifyRequest(self.seq, self.pos, [self.history.ids[-1]] + drafts, draft_probs)
        self._pending = (step, rnd, time.perf_counter())
        return step

    def _start_round(self, alone: bool) -> tuple[Round, int]:
        """A speculative round's record (the policy's k, a padded call's free row, the
        policy's prices for a greedy request) and the drafts to ask the drafter for."""
        # The recovered or bonus token is free: with r tokens left, r - 1 drafts suffice.
        remaining, room = self.stopper.max_new_tokens - self.history.output_len - 1, self.capacity - self.pos - 1
        rnd = Round(asked=self.policy.next_k(remaining))
        k = min(rnd.asked, room)
        if k == 0 and alone and min(remaining, room) > 0 and self._free_row():
            k = 1  # the padded call computes a second row anyway: a lookup's draft rides in it
        # the first draft's row is free in a padded call: proposed even where the drafter is unsure
        rnd.free_rows = 1 if alone and self._padded_greedy() else 0
        rnd.prices = self.policy.draft_prices() if self.mode.priced and k > 0 else None
        rnd.overlapped = self.overlapping
        return rnd, k

    def _free_row(self) -> bool:
        """Whether a one-token draft rides free: the target pads a one-token call to two
        rows anyway, the drafter is a lookup, and the mode prices the request (RequestMode.priced)."""
        return self._padded_greedy() and self.drafter.model_free

    def _padded_greedy(self) -> bool:
        return self.mode.priced and self.target.pads_single_row

    def score(self, step: VerifyRequest):
        """The target alone scores the step's rows (greedy ids, or float64
        distributions when sampling): what accept() takes."""
        return self._scored(step.tokens, step.start, len(step.tokens))

    def batch_item(self, step: VerifyRequest) -> BatchItem:
        """The step as this request's share of a batched target call."""
        return BatchItem(step.seq_id, step.tokens, step.start, len(step.tokens))

    def score_logits(self, logits):
        """What score() returns, from the target's logits for this request's rows
        (a batched forward's share)."""
        step = self._pending[0] if self._pending is not None else None
        return self.scorer.score(logits, self.history, step.drafts if step is not None else [])

    def accept(self, step: VerifyRequest, scored, verify_s: float | None = None) -> bool:
        """Accept against the target's scores for the step's rows and commit (the
        target's cache rolls back to the committed length); True when generation is
        over. verify_s: this request's share of a batched call (default: the time
        since propose)."""
        if self._pending is None or step is not self._pending[0]:
            raise GenerationError("accept() takes the step this request's last propose() returned")
        _, rnd, began = self._pending
        self._pending = None
        drafts = step.drafts
        if self.sampler is None:
            accepted, tokens = accept_greedy(drafts, scored)
        else:
            accepted, tokens = self.sampler.accept(drafts, scored, step.draft_probs, self.history.output_len)
        self.target.truncate(self.seq, self.pos + accepted + 1)  # rollback: a length change
        self._keep_features(accepted + 1)  # the rows of the last committed token and the accepted drafts
        self._account(rnd, len(drafts), accepted, time.perf_counter() - began if verify_s is None else verify_s)
        return self._commit(tokens)

    def set_round_cost(self, cost) -> None:
        """Price this request's rounds (a batching server's RoundCost for its batch).
        Only where the mode prices its rounds (scheduler/mode.py); a request that
        does not speculate has no policy of its own to price (it may share the engine's)."""
        if self.mode.priced and self.drafter is not None:
            self.policy.set_cost(cost)

    def close(self, release: bool = True) -> GenerationResult:
        """Free the sequence (unless release=False: a prefix cache keeps it) and the
        drafter's state; the result so far."""
        if release:
            self.target.release(self.seq)
        if self.constrainer is not None:
            self.constrainer.close()
        if self.drafter is not None:
            self.drafter.reset()
        self._take_events()
        stats = self.stats
        stats.total_s, stats.new_tokens = time.perf_counter() - self.started_at, self.history.output_len
        stats.finish_reason = self.stopper.reason
        return GenerationResult(self.stopper.text(), self.history.output, stats, self.token_logprobs)

    # ------------------------------------------------------------ inside the phases
    def _scored(self, tokens: list[int], start: int, n: int):
        if self.scorer.plain:
            return self.target.greedy(self.seq, tokens, start, n)
        return self.score_logits(self.target.forward(self.seq, tokens, start, n))

    def _keep_features(self, rows: int) -> None:
        """Keep the first `rows` rows of the target's features from its latest call on this sequence."""
        if self.feed.features is not None:
            self.feed.keep(self.target.take_features(self.seq), rows)

    def _draft(self, rnd: Round, k: int):
        """(drafts, their distributions or None); the drafter fills its part of the round,
        or the pre-draft made during the last verify does, where it still holds."""
        ahead, self._ahead = self._ahead, None
        hit = ahead.take(self.history.ids, k) if ahead is not None else None
        if hit is not None:
            ahead.fill(rnd)
            self.stats.predraft_hits += 1
            return list(hit[0]), hit[1]
        req = self.feed.request(self.seq, self.history.ids, k)
        t0 = time.perf_counter()
        proposal = self.drafter.draft(req, rnd)
        rnd.draft_s = time.perf_counter() - t0
        self.stats.draft_s += rnd.draft_s
        if self._take_events():  # a failover in this call: its time is not a draft cost
            rnd.draft_s = None
        drafts = proposal.tokens[:k]
        probs = None if proposal.probs is None else proposal.probs[:len(drafts)]
        if self.constrainer is not None:
            drafts, probs = self.constrainer.cut(drafts, probs, k)
        return list(drafts), probs

    def _account(self, rnd: Round | None, drafted: int, accepted: int, verify_s: float) -> None:
        stats = self.stats
        stats.verify_s += verify_s
        stats.rounds, stats.drafted, stats.accepted = stats.rounds + 1, stats.drafted + drafted, \
            stats.accepted + accepted
        stats.count_positions(drafted, accepted)
        swapped = self._take_events()  # a target swap in the verify: its time teaches no cost
        if rnd is None:  # (target-only rounds feed no policy)
            return
        rnd.drafted, rnd.accepted, rnd.verify_s = drafted, accepted, verify_s
        rnd.learnt = not swapped and self.mode.learns_timings
        self.policy.observe(rnd)
        self.drafter.observe(drafted, accepted)

    def _take_events(self) -> list[str]:
        events = self.target.take_events() + (self.drafter.take_events() if self.drafter is not None else [])
        self.stats.events += events
        if not self.target.precision.batch_invariant:
            self.stats.lossless = "up to numerics"
        return events

    def _commit(self, tokens: list[int]) -> bool:
        """Append committed tokens to the history (the stop checker does); True when
        generation is over."""
        con = self.constrainer
        for i, token in enumerate(tokens):
            if token not in self.stopper.eos_ids:
                self.scorer.record(i, token)
            if con is not None and token not in self.stopper.eos_ids and con.commit(token):
                # The language ended: stop where target-only would. A stop string this
                # token completes keeps its reason (the text is cut there).
                if not self.stopper.feed(token) or self.stopper.reason == "length":
                    self.stopper.reason = "grammar"
                return True
            if self.stopper.feed(token):
                return True
        self.pos = len(self.history) - 1  # the newest token is fed with the next step
        return False


class DraftFeed:
    """What the drafter has been told: the history's first `told` tokens, and the target's
    hidden states of rows whose next token is committed, not yet sent (a head drafter
    reads them; None where no drafter reads features)."""

    def __init__(self, features: bool):
        self.told = 0
        self.features: list | None = [] if features else None

    def keep(self, got, rows: int) -> None:
        """The first `rows` rows of the target's latest features (None: a failover replayed
        the sequence, and the drafter goes without these rows)."""
        if got is None:
            self.features.clear()
        else:
            self.features.append(got[:rows])

    def request(self, seq: int, ids: list[int], k: int) -> DraftRequest:
        """The next draft request: the tokens committed since the last one, and the features kept."""
        req = DraftRequest(seq, self.told, k, ids[self.told:], context=ids)
        if self.features:
            req.features = self.features[0] if len(self.features) == 1 else np.concatenate(self.features)
            self.features.clear()
        self.told = len(ids)
        return req


__all__ = ["GenerationResult", "Request", "TokenLogprob"]
