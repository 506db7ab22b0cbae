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

from hetero_sd.backends.base import BatchItem
from hetero_sd.errors import GenerationError
from hetero_sd.failover import FailoverDrafter, FailoverRunner
from hetero_sd.ir.work import DraftRequest, TokenHistory, VerifyRequest
from hetero_sd.sampling import Sampler, SamplingParams, accept_greedy, penalize
from hetero_sd.stats import GenerationStats
from hetero_sd.stopping import StopChecker


@dataclass
class TokenLogprob:
    """A committed token's log-probability under the target's distribution for its
    position, after the request's sampling warps and grammar mask (the distribution
    it was decided from), and the `top` most likely (token, log-probability) pairs."""
    token: int
    logprob: float
    top: list[tuple[int, float]]


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
    """One request's state: its token history, the target's sequence and the
    position the next step starts at, and how much of the history the drafter
    has been told. Made by Engine.request."""

    def __init__(self, target: FailoverRunner, drafter: FailoverDrafter | None, policy, sampler: Sampler | None,
                 stopper: StopChecker, stats: GenerationStats, history: TokenHistory, learn_timings: bool = True,
                 logprobs: int | None = None, penalties: SamplingParams | None = None):
        self.target, self.drafter, self.policy, self.sampler = target, drafter, policy, sampler
        self.stopper, self.stats, self.history = stopper, stats, history
        # Drafts are capped at the tokens still wanted, so no verify writes past
        # position n + budget - 2: the prompt plus the budget always suffices.
        self.capacity = min(len(history) + stopper.max_new_tokens, target.max_context)
        self.started_at = time.perf_counter()
        self.seq = target.allocate(self.capacity, history)
        self.pos = 0  # positions of the target's cache the next step starts at
        self.told = 0  # tokens of the history the drafter has been told
        self.constrainer = None  # hetero_sd.constraint.rounds.Constrainer when the output has a grammar
        # Whether the draft-length policy learns from timings. Off, its choices
        # depend on acceptance alone, so a seeded sampled request draws the same
        # tokens whatever runs beside it (the batching server).
        self.learn_timings = learn_timings
        # The target's hidden states of rows whose next token is committed, not yet
        # told to the drafter: a head drafter reads them (a target loaded with
        # feature layers only when one is configured).
        self.features: list | None = [] if drafter is not None and target.feature_layers else None
        # logprobs: None, or how many top alternatives each committed token reports with its
        # own log-probability; the rows of the latest scored call, as log-probabilities.
        self.logprobs, self.token_logprobs = logprobs, ([] if logprobs is not None else None)
        self._log_rows: np.ndarray | None = None
        self.penalties = penalties  # SamplingParams whose penalties apply to every row scored (None: none)
        self._step: VerifyRequest | None = None  # the step proposed and not yet accepted
        self._step_at, self._step_draft_s, self._step_speculating = 0.0, None, False
        self._step_lookup = False  # the step's drafts came from a lookup (DraftResult.lookup)
        self._step_catch_up = 0.0  # of the step's draft seconds, taking in context (DraftResult.catch_up_s)

    @property
    def last_draft_s(self) -> float | None:
        """Seconds the latest propose() spent drafting (None: it drafted nothing, or a
        failover happened in the call)."""
        return self._step_draft_s

    @property
    def tokens(self) -> list[int]:
        """The output so far (committed tokens after the prompt)."""
        return self.history.output

    def constrain(self, guide, eos_ids: set[int], model_vocab: int) -> None:
        from hetero_sd.constraint.rounds import Constrainer

        self.constrainer = Constrainer(guide, eos_ids, self.stats, model_vocab)

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
            if step is None or self.accept(step, self.score(step)):
                return

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
        speculating = draft and self.speculating
        # The recovered or bonus token is free: with r tokens left, r - 1 drafts suffice.
        remaining, room = self.stopper.max_new_tokens - self.history.output_len - 1, self.capacity - self.pos - 1
        k = min(self.policy.next_k(remaining), room) if speculating else 0
        if k == 0 and speculating and alone and min(remaining, room) > 0 and self._free_row():
            k = 1  # the padded call computes a second row anyway: a lookup's draft rides in it
        # the first draft's row is free in a padded call: proposed even where the drafter is unsure
        free = 1 if alone and self._padded_greedy() else 0
        self._step_lookup, self._step_catch_up = False, 0.0
        drafts, draft_probs, draft_s = self._draft(k, free) if k > 0 else ([], None, None)
        if self.constrainer is not None:
            self.constrainer.prepare(drafts)
        self._step = VerifyRequest(self.seq, self.pos, [self.history.ids[-1]] + drafts, draft_probs)
        self._step_at, self._step_draft_s, self._step_speculating = time.perf_counter(), draft_s, speculating
        return self._step

    def _free_row(self) -> bool:
        """Whether a one-token draft rides free: the target pads a one-token call to two
        rows anyway, the drafter is a lookup, and the request is greedy (a seeded sample's
        draft lengths follow its acceptance alone, whatever runs beside it)."""
        return self._padded_greedy() and self.drafter.model_free

    def _padded_greedy(self) -> bool:
        return self.greedy and self.target.pads_single_row

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
        if self.penalties is not None:
            step = self._step
            logits = penalize(logits, self.penalties, self.history.ids[:self.history.prompt_len],
                              self.history.output, step.drafts if step is not None else [])
        if self.constrainer is not None:
            logits = self.constrainer.apply(logits)
        if self.sampler is None:
            if self.logprobs is not None:
                self._log_rows = _log_softmax(logits)
            return [int(i) for i in logits.argmax(-1)]
        probs = self.sampler.probs(logits)
        if self.logprobs is not None:
            with np.errstate(divide="ignore"):  # a token the warps removed: log 0 = -inf
                self._log_rows = np.log(probs)
        return probs

    def accept(self, step: VerifyRequest, scored, verify_s: float | None = None) -> bool:
        """Accept against the target's scores for the step's rows and commit (the
        target's cache rolls back to the committed length); True when generation is
        over. verify_s: this request's share of a batched call (default: the time
        since propose)."""
        if step is not self._step:
            raise GenerationError("accept() takes the step this request's last propose() returned")
        self._step = None
        drafts = step.drafts
        if self.sampler is None:
            accepted, tokens = accept_greedy(drafts, scored)
        else:
            accepted, tokens = self.sampler.accept(drafts, scored, step.draft_probs, self.history.output_len)
        self.target.truncate(self.seq, self.pos + accepted + 1)  # rollback: a length change
        self._keep_features(accepted + 1)  # the rows of the last committed token and the accepted drafts
        self._account(len(drafts), accepted,
                      time.perf_counter() - self._step_at if verify_s is None else verify_s)
        return self._commit(tokens)

    def set_round_cost(self, cost) -> None:
        """Price this request's rounds (a batching server's RoundCost for its batch).
        A sampled request keeps its policy's prior, so its draft lengths follow
        acceptance alone and a seed reproduces whatever runs beside it. A request
        that does not speculate has no policy of its own to price (it may share
        the engine's)."""
        if self.sampler is None and self.drafter is not None:
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
        if self.constrainer is None and self.sampler is None and self.logprobs is None and self.penalties is None:
            return self.target.greedy(self.seq, tokens, start, n)
        return self.score_logits(self.target.forward(self.seq, tokens, start, n))

    def _keep_features(self, rows: int) -> None:
        """Keep the first `rows` rows of the target's features from its latest call on this sequence."""
        if self.features is None:
            return
        got = self.target.take_features(self.seq)
        if got is None:  # (a failover replayed the sequence: the drafter goes without these rows)
            self.features.clear()
        else:
            self.features.append(got[:rows])

    def _draft(self, k: int, free: int = 0):
        """(drafts, their distributions or None, seconds); `free`: DraftRequest.free_rows."""
        ids = self.history.ids
        req = DraftRequest(self.seq, self.told, k, ids[self.told:], context=ids, free_rows=free,
                           prices=self.policy.draft_prices() if self.greedy else None)
        if self.features:
            req.features = self.features[0] if len(self.features) == 1 else np.concatenate(self.features)
            self.features.clear()
        t0 = time.perf_counter()
        proposal = self.drafter.draft(req)
        seconds = time.perf_counter() - t0
        self.stats.draft_s += seconds
        if self._take_events():  # a failover in this call: its time is not a draft cost
            seconds = None
        self.told = len(ids)
        self._step_lookup, self._step_catch_up = proposal.lookup, proposal.catch_up_s
        drafts = proposal.tokens[:k]
        probs = None if proposal.probs is None else proposal.probs[:len(drafts)]
        if self.constrainer is not None:
            drafts, probs = self.constrainer.cut(drafts, probs, k)
        return list(drafts), probs, seconds

    def _account(self, drafted: int, accepted: int, verify_s: float) -> None:
        stats, draft_s = self.stats, self._step_draft_s
        stats.verify_s += verify_s
        stats.rounds, stats.drafted, stats.accepted = stats.rounds + 1, stats.drafted + drafted, \
            stats.accepted + accepted
        stats.count_positions(drafted, accepted)
        if self._take_events() or not self.learn_timings:  # a target swap in the verify: its time teaches no cost
            draft_s = verify_s = None
        if self._step_lookup:  # a hybrid's lookup round: no draft step was taken to price
            draft_s = None
        if self._step_speculating:  # (target-only rounds feed no policy)
            self.policy.observe(drafted, accepted, draft_s=draft_s, verify_s=verify_s, catch_up_s=self._step_catch_up)
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
            if self.token_logprobs is not None and token not in self.stopper.eos_ids:
                self.token_logprobs.append(self._logprob(i, token))
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


    def _logprob(self, row: int, token: int) -> TokenLogprob:
        """Token `token`'s entry from row `row` of the latest scored call (the row that decided it)."""
        lp = self._log_rows[row]
        top = []
        if self.logprobs:
            best = np.argpartition(-lp, self.logprobs - 1)[:self.logprobs]
            best = best[np.lexsort((best, -lp[best]))]  # most likely first; ties by id
            top = [(int(t), float(lp[t])) for t in best]
        return TokenLogprob(int(token), float(lp[token]), top)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-probabilities of float32 logits rows (a masked -inf stays -inf)."""
    x = logits.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


__all__ = ["GenerationResult", "Request", "TokenLogprob"]
