"""The pre-draft: round r+1's drafts, made while the target verifies round r.

scheduler/overlap.py decides when a request overlaps; hetero_sd/request.py
submits the verify, calls `predraft` and waits. The drafter is asked for the
tokens after the committed history plus round r's drafts: the first is a guess
of the bonus token, the rest round r+1's drafts. They are used only when round r
commits exactly its drafts and that guess (`PreDraft.take`); otherwise they are
thrown away and round r+1 drafts serially. What the target commits never
depends on a draft's content, so either way the output is target-only's (greedy)
or follows the target's distribution (sampled: a pre-drafted token was drawn
from the draft's distribution after the very context it is used in).

The drafter is told the speculative context as a delta from what it was told
(`base_len` = the feed's `told`), and the feed then counts only the committed
part as told: the next request rolls the drafter back past the drafts that
did not hold (Drafter.predrafts: every drafter that pre-drafts takes that).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from hetero_sd.ir.work import DraftRequest
from hetero_sd.scheduler.round import Round


@dataclass
class PreDraft:
    context_len: int  # the history's length if round r commits its drafts and the guess
    tail: list[int]  # round r's drafts and the guess: the history's last tokens then
    drafts: list[int]  # round r+1's drafts
    probs: object  # their distributions (numpy rows), None for one-hot drafts
    catch_up_s: float = 0.0
    lookup: bool = False

    def take(self, ids, k: int):
        """(drafts, probs) for a round of at most k drafts after the history `ids`,
        None when round r did not commit what this pre-draft assumed."""
        n = len(self.tail)
        if k <= 0 or len(ids) != self.context_len or list(ids[len(ids) - n:]) != self.tail:
            return None
        return self.drafts[:k], None if self.probs is None else self.probs[:min(k, len(self.drafts))]

    def fill(self, rnd: Round) -> None:
        """A hit's round: its drafting took no critical time."""
        rnd.draft_s, rnd.predrafted = 0.0, True
        rnd.catch_up_s, rnd.lookup = self.catch_up_s, self.lookup


def predraft(drafter, feed, seq: int, ids, drafts: list[int], k: int, prices=None) -> PreDraft | None:
    """Ask `drafter` for a guess and k drafts after ids + drafts (DraftFeed `feed` tells it
    the delta); None when it has fewer than a guess and one draft."""
    context = list(ids) + list(drafts)
    req = DraftRequest(seq, feed.told, k + 1, context[feed.told:], context=context)
    feed.told = len(ids)  # round r's drafts may not hold: the next request rolls back to here
    rnd = Round(asked=k + 1, prices=prices)
    proposal = drafter.draft(req, rnd)
    tokens = list(proposal.tokens[:k + 1])
    if len(tokens) < 2:
        return None
    probs = None if proposal.probs is None else proposal.probs[1:len(tokens)]
    return PreDraft(len(context) + 1, list(drafts) + tokens[:1], tokens[1:], probs, rnd.catch_up_s, rnd.lookup)


def hidden_seconds(pending, t0: float, drafted_at: float) -> float:
    """Of a pre-draft from t0 to drafted_at, the seconds the device was still verifying:
    up to when it finished (Pending.done_at), all of it where the wait then blocked, none
    where the runner cannot say when it finished and the wait did not block."""
    now = time.perf_counter()
    done = pending.done_at if pending.done_at is not None else now if now - drafted_at > WAITED_S else t0
    return min(drafted_at - t0, max(0.0, done - t0))


WAITED_S = 1e-4  # a wait this long blocked on the device: it was still busy when the pre-draft ended


__all__ = ["PreDraft", "hidden_seconds", "predraft"]
