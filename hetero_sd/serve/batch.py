"""Continuous batching: many requests, one target call per step.

Requests join and leave the running set at step boundaries. A step:
  1. admits waiting requests (priority order, hetero_sd.scheduler.admission)
     while the target's KV pool has room, and prefills each alone, the same
     call `hetero-sd generate` makes;
  2. lets every running request propose its step (its own drafter and draft length);
  3. scores every request's step in ONE batched target call (Runner.forward_batch,
     each row rounding exactly as alone: the backends prove it bitwise);
  4. accepts and commits per request, and streams what each committed.
Each request is a hetero_sd.request.Request, driven only through its phases.
A request's output therefore equals its solo output token for token, whatever
runs beside it; its sampler is its own, so a seed reproduces.

Everything runs on one engine thread; `submit` and `Handle.cancel` are safe
from any thread, and events are delivered on the engine thread (the server
hands them to its event loop). Work that may be slow (a grammar's compile, a
drafter's fork, a prefix's copy) runs outside the lock `submit` takes.

Failures stay with their request: an error in one request's admission, prefill,
propose, scoring or accept ends that request alone with finish_reason "error"
and the cause; only a failed batched target call fails the batch. Should the
thread die anyway, `failure` says why, every waiting and running request ends
with an error, `submit` raises EngineDown (503), and `on_death` is called (the
server exits non-zero then, for its supervisor to restart it).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from hetero_sd.errors import GenerationError, HeteroSDError, KVBudgetError, describe
from hetero_sd.request import Request
from hetero_sd.scheduler.admission import AdmissionQueue, QueueFull
from hetero_sd.scheduler.batch_cost import BatchCost
from hetero_sd.scheduler.batch_gate import SpeculationGate
from hetero_sd.serve.faults import FaultPlan, fire
from hetero_sd.serve.prefix import PrefixCache
from hetero_sd.serve.records import Event, Handle, Submission
from hetero_sd.stopping import TextStream

log = logging.getLogger("hetero_sd.serve")

__all__ = ["BatchEngine", "EngineDown", "Event", "Handle", "QueueFull", "ShuttingDown", "Submission"]


class ShuttingDown(HeteroSDError):
    """The server stopped admitting requests."""


class EngineDown(ShuttingDown):
    """The batch engine's thread died; nothing more is served."""


@dataclass
class _Live:
    handle: Handle
    req: Request
    stream: TextStream
    cached: int = 0  # prompt positions copied from the prefix cache
    sent_tokens: int = 0
    started: bool = False


class BatchEngine:
    """Serve an Engine's target and drafter to many concurrent requests.

    max_running: sequences stepped together (the batch); max_waiting: the
    queue bound (past it, submit raises QueueFull); prefills_per_step: new
    requests prefilled per step, so arrivals do not stall running streams."""

    def __init__(self, engine, max_running: int = 16, max_waiting: int = 64, prefills_per_step: int = 2,
                 ageing_s: float = 10.0, on_finish: Callable[[Handle, object], None] | None = None,
                 on_step: Callable[[int, int], None] | None = None, prefix_cache: int = 8,
                 faults: FaultPlan | None = None, on_death: Callable[[str], None] | None = None):
        self.engine = engine
        self.target = engine.target_runner  # (a FailoverRunner: a device failure moves the whole batch)
        self.max_running, self.prefills_per_step = max_running, prefills_per_step
        self.on_finish, self.on_step = on_finish, on_step  # on_step(sequences, rows) after each batched call
        self.faults, self.on_death = faults, on_death
        self.failure: str | None = None  # why the engine thread died (None: it did not)
        self.cost = BatchCost()
        self.gate = SpeculationGate()  # whether greedy requests draft, measured per batch size
        # Finished requests' KV kept for prompts that begin alike (prefix.py): only where
        # the runner can copy KV exactly; prefix_cache = how many sequences (0 = off).
        self.prefix = PrefixCache(self.target, prefix_cache) if prefix_cache > 0 and \
            self.target.can_copy_prefix else None
        self._draft_s_per_token = 0.0
        self._queue: AdmissionQueue[Handle] = AdmissionQueue(max_waiting, ageing_s)
        self._running: list[_Live] = []
        self._popped: list[Handle] = []  # taken from the queue, not yet running
        self._cond = threading.Condition()
        self._admitting = True
        self._drain_deadline: float | None = None
        self._thread: threading.Thread | None = None
        self.steps = 0

    # ------------------------------------------------------------ any thread
    @property
    def speculative(self) -> bool:
        """Whether requests can speculate: the drafter can serve several sequences at once."""
        return self.engine.forks_drafter

    def counts(self) -> tuple[int, int]:
        """(running, waiting)."""
        with self._cond:
            return len(self._running), len(self._queue)

    def kv_state(self) -> dict:
        """The target's pool as /metrics shows it: reserved share, the share of positions
        filled by requests (not the prefix cache's), sequences held, and the cache's."""
        # (read from the server's thread while the engine thread steps: a scrape under load
        # may pair a pool and a cache a step apart; idle, the figures are exact)
        u = self.target.usage()
        cached = self.prefix.held_tokens() if self.prefix is not None else 0
        kept = len(self.prefix) if self.prefix is not None else 0
        cap = u.capacity_tokens or 1
        return {"usage": u.used_tokens / cap, "request_usage": max(0, u.filled_tokens - cached) / cap,
                "sequences": u.sequences, "prefix_sequences": kept}

    def check(self, req: Submission) -> None:
        """GenerationError (a client error, HTTP 400) for a request that can never run."""
        budget = self.engine.check_request(req.prompt_ids, req.max_new_tokens)
        n, ctx = len(req.prompt_ids), self.target.max_context
        if n + budget > ctx:
            raise GenerationError(f"the prompt ({n} tokens) plus max_tokens ({budget}) exceeds the model's "
                                  f"context of {ctx} tokens; lower max_tokens to at most {ctx - n}")
        u = self.target.usage()
        if n + budget > u.capacity_tokens:
            raise GenerationError(f"the request needs {n + budget} KV positions but the target's whole pool "
                                  f"holds {u.capacity_tokens} (memory.kv_budget); lower max_tokens or the prompt")

    def submit(self, req: Submission, on_event: Callable[[Event], None]) -> Handle:
        """Queue a request; GenerationError (400), QueueFull (429) or ShuttingDown (503) if it cannot."""
        self.check(req)
        handle = Handle(req, on_event)
        if self.faults is not None:
            handle.faults = self.faults.matching(req.prompt_ids)
        with self._cond:
            if self.failure is not None:
                raise EngineDown(f"the server's batch engine stopped ({self.failure}); it admits nothing")
            if not self._admitting:
                raise ShuttingDown("the server is shutting down and admits no new request")
            self._queue.push(handle, req.priority)
            self._cond.notify()
        return handle

    def start(self) -> "BatchEngine":
        self._thread = threading.Thread(target=self._loop, name="hetero-sd-batch", daemon=True)
        self._thread.start()
        return self

    def shutdown(self, drain_s: float = 30.0) -> None:
        """Stop admission; requests already accepted finish within drain_s, the
        rest end with finish_reason "abort" (their output so far kept)."""
        with self._cond:
            self._admitting = False
            self._drain_deadline = time.monotonic() + drain_s
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()

    # ------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 -- a bug of ours or MemoryError: say so, fail fast
            self.failure = describe(exc)
            log.critical("the batch engine stopped: %s", self.failure, exc_info=True)
            self._fail_all(f"the server's batch engine stopped: {self.failure}")
            if self.on_death is not None:
                self.on_death(self.failure)
        finally:  # the kept prefixes' sequences go back to the pool
            if self.prefix is not None:
                self.prefix.clear()

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._running and not len(self._queue) and self._admitting:
                    self._cond.wait()
                if not self._running and not len(self._queue):
                    return  # shutting down, nothing left
                now = time.monotonic()
                if self._drain_deadline is not None and now > self._drain_deadline:
                    self._abort_all()
                    return
                cancelled = self._queue.remove(lambda h: h.cancelled)
                expired = self._queue.remove(lambda h: h.expired(now))
                popped = self._pop_admissions()
                for handle, _, _ in popped:
                    fire(handle.faults, "thread")
            for h in cancelled:
                self._emit_final(h, None, "cancelled")
            for h in expired:
                self._emit_final(h, None, "timeout")
            for live in [x for x in self._running if x.handle.expired(now)]:
                self._end(live, "timeout")
            admitted = self._admit(popped)
            self._popped = []
            try:
                self._step(admitted)
            except Exception as exc:  # the batched target call failed: fail the batch, keep serving
                log.exception("batch step failed")
                for live in list(self._running):
                    self._end(live, "error", describe(exc))

    def _pop_admissions(self) -> list[tuple[Handle, float, float]]:
        """The waiting requests to admit this step (under the lock; built outside it)."""
        room = min(self.max_running - len(self._running), self.prefills_per_step)
        popped = []
        while len(popped) < room and (entry := self._queue.pop()) is not None:
            popped.append(entry)
        self._popped = [handle for handle, _, _ in popped]  # (in neither the queue nor the running set)
        return popped

    def _admit(self, popped: list[tuple[Handle, float, float]]) -> list[_Live]:
        out = []
        for i, (handle, priority, arrived) in enumerate(popped):
            try:
                fire(handle.faults, "admit")
                live = self._new_live(handle)
            except KVBudgetError as exc:
                if self._running:  # no room now: wait (in order) for a request to leave
                    with self._cond:
                        for entry in reversed(popped[i:]):
                            self._queue.push_front(*entry)
                    break
                self._emit_final(handle, None, "error", str(exc))
                continue
            except Exception as exc:  # this request's failure alone (a tokenizer, a grammar, memory)
                log.warning("admitting a request failed: %s", describe(exc))
                self._emit_final(handle, None, "error", _cause(exc))
                continue
            self._queue.served_s = 0.9 * self._queue.served_s + 0.1 * (time.monotonic() - arrived)
            self._running.append(live)
            out.append(live)
        return out

    def _new_live(self, handle: Handle) -> _Live:
        sub = handle.request
        while True:
            try:
                # (concurrent: priced by the batch cost model, _price; scheduler/mode.py)
                req = self.engine.request(sub.prompt_ids, sub.max_new_tokens, sub.stop, sub.sampling,
                                          sub.constraint, speculate=sub.speculate, concurrent=True,
                                          logprobs=sub.logprobs)
                break
            except KVBudgetError:  # the pool's room goes to running requests before cached prefixes
                if self.prefix is None or not self.prefix.evict():
                    raise
        cached = 0
        hit = self.prefix.find(sub.prompt_ids, sub.tenant) if self.prefix is not None else None
        if hit is not None:
            try:  # (False: a failover moved the target to a runner that cannot copy)
                cached = hit.length if self.target.copy_prefix(hit.seq, req.seq, hit.length) else 0
            except BaseException:
                req.close()  # its sequence is freed; the request fails alone
                raise
        return _Live(handle, req, TextStream(req.stopper), cached)

    def _step(self, admitted: list[_Live]) -> None:
        for live in admitted:
            if live.handle.cancelled:
                continue
            try:
                fire(live.handle.faults, "prefill")
                done = live.req.start(live.cached)  # the prefill: alone, as a solo run makes it
            except Exception as exc:  # this request's failure alone (the others go on)
                self._fail(live, "prefill", exc)
                continue
            live.started = True
            self._publish(live, done)
        for live in [x for x in self._running if x.handle.cancelled]:
            self._end(live, "cancelled")
        self._price()
        started = [x for x in self._running if x.started]
        # Alone, a request's call is its own and its policy's price is right: the gate is for batches
        gated = len(started) > 1 and any(x.req.mode.priced and x.req.speculating for x in started)
        draft = self.gate.decide(len(started)) if gated else True
        t_step, committed = time.perf_counter(), sum(x.req.history.output_len for x in started)
        batch = []
        for live in started:
            try:
                fire(live.handle.faults, "propose")
                # (the gate prices only what the batch prices; a lone step may fill a padded call's free row)
                step = live.req.propose(draft=draft or not live.req.mode.priced, alone=len(started) == 1)
            except Exception as exc:
                self._fail(live, "propose", exc)
                continue
            if step is None:  # the context is full
                self._publish(live, True)
            else:
                batch.append((live, step))
        if not batch:
            return
        rows = sum(len(step.tokens) for _, step in batch)
        t0 = time.perf_counter()
        logits = self.target.forward_batch([live.req.batch_item(step) for live, step in batch])
        seconds = time.perf_counter() - t0
        self.cost.observe(rows, seconds)
        self.steps += 1
        if self.on_step is not None:
            self.on_step(len(batch), rows)
        drafted = sum(len(step.drafts) for _, step in batch)
        if drafted:
            spent = sum(live.req.round.draft_s or 0.0 for live, _ in batch if live.req.round is not None)
            self._draft_s_per_token = 0.9 * self._draft_s_per_token + 0.1 * spent / drafted
        for (live, step), out in zip(batch, logits):
            share = self.cost.share(len(step.tokens), len(batch))
            try:
                fire(live.handle.faults, "score")
                scored = live.req.score_logits(out)
                fire(live.handle.faults, "accept")
                done = live.req.accept(step, scored, verify_s=share)
            except Exception as exc:
                self._fail(live, "score/accept", exc)
                continue
            self._publish(live, done)
        if gated:
            tokens = sum(x.req.history.output_len for x in started) - committed
            self.gate.observe(len(started), draft, tokens, time.perf_counter() - t_step)

    def _fail(self, live: _Live, phase: str, exc: Exception) -> None:
        """End one request that failed in `phase`; the log keeps the cause, the client gets it too."""
        log.warning("a request failed in %s: %s", phase, describe(exc))
        log.debug("the failure's traceback", exc_info=exc)  # (--log-level debug)
        self._end(live, "error", _cause(exc))

    def _price(self) -> None:
        """Give every greedy request's draft-length policy the cost of a round in
        this batch: alone, drafts ride on the weight reads the call makes anyway;
        beside many others each draft row costs about what a committed row does,
        and the policy drafts less or stops (hetero_sd.scheduler.batch_cost)."""
        cost = self.cost.round_cost(len(self._running), self._draft_s_per_token)
        for live in self._running:
            live.req.set_round_cost(cost)

    def _publish(self, live: _Live, done: bool) -> None:
        if done:
            self._end(live, None)
            return
        new = live.req.history.output_since(live.sent_tokens)
        if new:
            live.sent_tokens += len(new)
            if live.handle.first_token_at is None:
                live.handle.first_token_at = time.monotonic()
            self._deliver(live.handle, Event(live.stream.delta(), list(new), logprobs=_logprobs_of(live, len(new))))

    def _end(self, live: _Live, reason: str | None, error: str | None = None) -> None:
        """Close the run (its sequence freed) and send the final event."""
        if live in self._running:
            self._running.remove(live)
        keep = self.prefix is not None and live.started and reason != "error"
        seq = live.req.seq
        try:
            result = live.req.close(release=not keep)
            if keep:  # its KV may serve a later prompt that begins alike (of the same tenant)
                self.prefix.offer(seq, self.target.tokens(seq), live.handle.request.tenant)
        except Exception as exc:  # what was streamed stays streamed; the request ends with the cause
            log.exception("closing a request failed")
            self._emit_final(live.handle, None, "error", error or _cause(exc))
            return
        reason = reason or result.stats.finish_reason or "stop"
        if reason in ("abort", "cancelled", "timeout", "error"):
            result.stats.finish_reason = reason
        new = list(result.token_ids[live.sent_tokens:])
        if new and live.handle.first_token_at is None:
            live.handle.first_token_at = time.monotonic()
        live.sent_tokens += len(new)
        self._emit_final(live.handle, result, reason, error, live.stream.delta(final=True), new,
                         _logprobs_of(live, len(new)))

    def _emit_final(self, handle: Handle, result, reason: str, error: str | None = None, text: str = "",
                    new: list[int] | None = None, logprobs: list | None = None) -> None:
        if self.on_finish is not None:
            try:
                self.on_finish(handle, result)
            except Exception:
                log.exception("on_finish failed")
        self._deliver(handle, Event(text, new or [], reason, result, error, logprobs))

    @staticmethod
    def _deliver(handle: Handle, event: Event) -> None:
        try:
            handle.on_event(event)
        except Exception:  # a listener's failure is its own; the batch goes on
            log.exception("event listener failed")

    def _abort_all(self) -> None:
        for h in self._queue.drain():
            self._emit_final(h, None, "abort")
        for live in list(self._running):
            self._end(live, "abort")

    def _fail_all(self, message: str) -> None:
        """The thread is dying: every request gets its final event, each on its own."""
        with self._cond:
            self._admitting = False
            waiting = self._queue.drain()
        running = {id(live.handle) for live in self._running}
        for h in waiting + [h for h in self._popped if id(h) not in running]:
            self._emit_final(h, None, "error", message)
        for live in list(self._running):
            try:
                self._end(live, "error", message)
            except BaseException:  # noqa: BLE001 -- even a broken close must not keep a client waiting
                if live in self._running:
                    self._running.remove(live)
                self._emit_final(live.handle, None, "error", message)


def _cause(exc: Exception) -> str:
    """What a client is told a failed request died of: our errors' own words, else the class too."""
    return str(exc) if isinstance(exc, HeteroSDError) else describe(exc)


def _logprobs_of(live: _Live, n: int) -> list | None:
    """The logprobs of the request's n newest sent tokens (None: not asked for)."""
    entries = live.req.token_logprobs
    return None if entries is None else entries[live.sent_tokens - n:live.sent_tokens]
