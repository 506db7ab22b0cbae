"""FailoverDrafter: a Drafter that never raises (the package docstring).

Two drafters, two names: `default` is the drafter each request begins with (a
failover's or re-plan's replacement once one happened: it persists);
`serving` is the one drafting the current request, None once it was dropped.
A replacement starts from the request's whole context (DraftRequest.context).
Drafters only read that context: one that appends to it is undone and dropped.
"""
from __future__ import annotations

from hetero_sd.drafting.base import Drafter
from hetero_sd.errors import GenerationError, describe
from hetero_sd.failover.fallback import Fallback, Replanner
from hetero_sd.ir.work import DraftRequest, DraftResult
from hetero_sd.scheduler.round import Round


class FailoverDrafter(Drafter):
    def __init__(self, drafter: Drafter | None, fallback: Fallback, replanner: Replanner | None = None):
        self.default, self.fallback, self.replanner = drafter, fallback, replanner
        self.serving: Drafter | None = None
        self.events: list[str] = []
        self._fresh = False  # `serving` has not been told the context yet
        self._capacity, self._sampler, self._guide = 0, None, None
        self._replans = True  # this request's rounds feed the Replanner (begin: RequestMode.replans)

    @property
    def name(self) -> str:
        return self.default.name if self.default is not None else "none"

    @property
    def active(self) -> bool:
        return self.serving is not None

    @property
    def model_free(self) -> bool:
        return self.serving is not None and self.serving.model_free

    @property
    def draft_device(self) -> str | None:
        return self.default.draft_device if self.default is not None else None

    @property
    def predrafts(self) -> bool:
        return self.default is not None and self.default.predrafts

    def take_events(self) -> list[str]:
        events, self.events = self.events, []
        return events

    def begin(self, capacity: int, sampler=None, guide=None) -> None:
        self._capacity, self._sampler, self._guide, self.serving = capacity, sampler, guide, None
        self._replans = sampler is None or sampler.mode.replans  # (scheduler/mode.py)
        self.forget_context()
        if self.default is not None:
            self._start(self.default)

    def _begin(self, drafter: Drafter) -> None:
        # A drafter written to the contract before guides (takes_guide False) is
        # begun without one: the engine cuts the drafts the grammar refuses.
        if self._guide is not None and drafter.takes_guide:
            drafter.begin(self._capacity, self._sampler, self._guide)
        else:
            drafter.begin(self._capacity, self._sampler)

    def _start(self, drafter: Drafter) -> None:
        try:
            self._begin(drafter)
        except Exception as exc:
            self._failed(drafter, exc)
            return
        self.serving, self._fresh = drafter, True

    def draft(self, req: DraftRequest, rnd: Round | None = None) -> DraftResult:
        context = self.context_for(req)
        if self.serving is None:
            return DraftResult(req.seq_id, [])
        if self._fresh:
            # (features align with the context's end: the replacement gets what this round has)
            req = DraftRequest(req.seq_id, 0, req.k, list(context), features=req.features, context=context)
        n = len(context)
        try:
            result = self.serving.draft(req, rnd)
            if len(context) != n:  # a drafter reads the history; one that wrote to it is a broken one
                if len(context) < n:
                    raise GenerationError(f"drafter {self.serving.name} removed tokens from the request's "
                                          "history; the output cannot be trusted")
                del context[n:]
                raise RuntimeError(f"drafter {self.serving.name} appended to the request's token history")
        except GenerationError:
            raise
        except Exception as exc:
            self._failed(self.serving, exc)
            return DraftResult(req.seq_id, [])
        self._fresh = False
        return result

    def _failed(self, drafter: Drafter, exc: BaseException) -> None:
        self.serving = None
        self.events.append(f"drafter {drafter.name} failed: {describe(exc)}")
        try:
            drafter.reset()
        except Exception:
            pass
        replacement = self.fallback.next_drafter(drafter, exc)
        if replacement is None:
            self.events.append("drafting continues with none")
            return
        self._start(replacement)  # one that fails to start is dropped the same way
        if self.serving is replacement:
            self.default = replacement  # persists: later requests draft with it
            self.events.append(f"drafting continues with {replacement.name}")

    def observe(self, drafted: int, accepted: int) -> None:
        """After a speculative round: tell the serving drafter (Drafter.observe), and let
        the Replanner swap it."""
        if self.serving is not None:
            self.serving.observe(drafted, accepted)
        if self.replanner is None or self.serving is None or not drafted or not self._replans:
            return
        replacement = self.replanner.on_round(drafted, accepted)
        if replacement is None:
            return
        old = self.serving
        try:
            self._begin(replacement)
        except Exception as exc:
            self.events.append(f"re-plan to {replacement.name} failed at start: {describe(exc)}")
            return
        try:
            old.reset()
        except Exception as exc:
            self.events.append(f"drafter {old.name} reset failed: {describe(exc)}")
        self.serving = self.default = replacement
        self._fresh = True
        self.events.append(f"acceptance drifted: drafter {old.name} -> {replacement.name}")

    def reset(self) -> None:
        if self.serving is not None:
            try:
                self.serving.reset()
            except Exception as exc:  # the output is complete; a broken drafter must not lose it
                self.events.append(f"drafter {self.serving.name} reset failed: {describe(exc)}")
        self.serving = None
        self.forget_context()

    def wait_ready(self) -> None:
        if self.default is not None:
            self.default.wait_ready()

    def close(self) -> None:
        if self.default is not None:
            self.default.close()
