"""The worker process: build the drafter once, then answer requests.

`main(spec, address, options, build=...)` is the process target
RemoteDrafter starts (spawn or forkserver; `build` is build.build_drafter,
passed in so this module does not import the builder that imports it). It
connects first, so the engine sees a death during
model load at once (a pid check on shared memory, EOF on a socket), then
loads, then loops: receive a request, answer it (wire.py says what is
said). It does not use transport.serve because asynchronous drafting works
between requests: with nothing to answer, it polls the channel with a zero
timeout between draft steps, and blocks only once it has drafted far enough.

Asynchronous drafting (`mode: async`, greedy requests only). After answering
with drafts d1..dk for committed context C, the worker assumes all k will be
accepted and the bonus will be its own next greedy token, and keeps extending
that guessed path G = C + d1..dk + b + ... up to `lookahead` tokens beyond the
reply. The next request says what was really committed (C'): if C' is a
prefix of G the reply comes from G at once (AHEAD; PARTIAL when G was too
short and the rest is drafted now), otherwise the drafter rolls back to the
common prefix (ModelDrafter keeps the longest common prefix of its cache) and
drafts fresh (FRESH). Under sampling the worker drafts on request only
(draws must follow the engine's order to be reproducible).
"""
from __future__ import annotations

import os
import struct
import time
from dataclasses import dataclass
from typing import Callable

from hetero_sd.backends.base import Runner
from hetero_sd.drafting.base import common_prefix
from hetero_sd.drafting.specs import DrafterSpec, ModelSpec
from hetero_sd.drafting.wire import (ACK, AHEAD, BEGIN, DRAFT, FRESH, HELLO, OK, PARTIAL, READY, RESET, Control,
                                     Reply, encode_reply, error_reply, sampler_from_words)
from hetero_sd.ir.work import MAX_DRAFT_TOKENS, DraftRequest, DraftResult
from hetero_sd.scheduler.round import Round
from hetero_sd.transport import PeerClosed, TransportTimeout, connect, planes

IDLE_WAIT_S = 3600.0  # a bounded wait between requests (see main)


@dataclass(frozen=True)
class WorkerOptions:
    target_vocab: int
    mode: str = "sync"  # sync | async (draft ahead between requests; greedy requests only)
    lookahead: int | None = None  # async: tokens to draft beyond a reply; None: k + 1
    threads: int | None = None  # torch / OpenMP threads in the worker; None: the runtime's default
    cpu: int | tuple[int, ...] | None = None  # pin the worker to this CPU or these CPUs (Linux)
    cache: str | None = None  # the engine's cache folder ($HETERO_SD_CACHE; None: the default one)
    # where draft distributions travel (transport/planes.py): host (the shm arena), cuda_ipc
    # (buffers on `plane_device`, shared once through CUDA IPC) or cpu_ipc (its CPU stand-in);
    # RemoteDrafter resolves a config's auto before it starts the worker
    data_plane: str = "host"
    plane_device: str = "cpu"


class Lookahead:
    """One sequence's guessed path (module docstring, async)."""

    def __init__(self, drafter, capacity: int, lookahead: int | None, step: int | None):
        self.drafter, self.capacity, self.lookahead, self.step = drafter, capacity, lookahead, step
        self.known: list[int] = []  # the committed context, as the engine last described it
        self.guess: list[int] = []  # known + tokens drafted beyond it
        self.fed = 0  # the drafter's context is guess[:fed]
        self.bound = 0  # draft ahead while len(guess) < bound
        self.seq_id = 0

    def answer(self, req: DraftRequest) -> tuple[list[int], int]:
        if req.base_len > len(self.known):
            raise ValueError(f"draft request base_len {req.base_len} beyond known {len(self.known)} tokens")
        ctx = self.known[:req.base_len] + list(req.new_tokens)
        self.known, self.seq_id, n = ctx, req.seq_id, len(ctx)
        if self.guess[:n] == ctx:  # the engine committed what we guessed
            have = len(self.guess) - n
            source = AHEAD if have >= req.k else PARTIAL if have else FRESH
            if have < req.k:
                self.fill(n + req.k)
        else:  # a rejection: roll back to what was committed and draft from there
            base = common_prefix(self.guess[:self.fed], ctx)
            drafts = self.drafter.draft(DraftRequest(req.seq_id, base, req.k, ctx[base:])).tokens[:req.k]
            self.guess, self.fed, source = ctx + list(drafts), n, FRESH
        # Next round if every draft is kept: the bonus and k more drafts.
        ahead = req.k + 1 if self.lookahead is None else self.lookahead
        self.bound = min(n + req.k + ahead, self.capacity)
        return self.guess[n:n + req.k], source

    def extend(self, upto: int) -> bool:
        """Draft one step further along the guessed path (a single token for a
        model, so requests are noticed between tokens); False when none was added."""
        want = min(upto, self.capacity) - len(self.guess)
        k = want if self.step is None else min(self.step, want)
        if k <= 0:
            return False
        proposal = self.drafter.draft(DraftRequest(self.seq_id, self.fed, k, self.guess[self.fed:]))
        self.fed = len(self.guess)
        self.guess.extend(proposal.tokens[:k])
        if not proposal.tokens:  # nothing to propose (an n-gram miss): stop guessing
            self.bound = len(self.guess)
            return False
        return True

    def fill(self, upto: int) -> None:
        while len(self.guess) < upto and self.extend(upto):
            pass

    @property
    def pending(self) -> bool:
        return len(self.guess) < self.bound


class Handler:
    """Turns request bytes into reply bytes for one drafter."""

    def __init__(self, channel, drafter, load_error: BaseException | None, options: WorkerOptions,
                 spec: DrafterSpec):
        self.channel, self.drafter, self.load_error, self.options = channel, drafter, load_error, options
        self.step = 1 if isinstance(spec, ModelSpec) else None  # poll between single model steps
        self.ahead: Lookahead | None = None
        self.ahead_s = 0.0  # seconds drafted ahead since the last reply
        try:
            self.plane = planes.writer_for(channel, options.data_plane, options.plane_device,
                                           planes.region_bytes(options.target_vocab, MAX_DRAFT_TOKENS))
        except Exception as exc:  # (no device buffers: every request learns why, as for a load error)
            self.plane, self.load_error = None, load_error or exc

    def __call__(self, msg: bytes) -> bytes:
        return encode_reply(self.channel, self.reply(msg), self.plane)

    def close(self) -> None:
        """Free the data plane's buffers (a worker exits without atexit handlers)."""
        if self.plane is not None:
            self.plane.close()

    def reply(self, msg: bytes) -> Reply:
        """The answer to one request, not yet encoded (a Ray actor sends its
        distributions beside the frame, through the object store)."""
        t0 = time.perf_counter()
        try:
            kind = struct.unpack_from("<i", msg)[0]
            if kind == Control.KIND:
                reply = self._control(Control.unpack(msg))
            elif kind == DraftRequest.KIND:
                reply = self._draft(DraftRequest.unpack(msg))
            else:
                raise ValueError(f"record kind {kind} is neither a DraftRequest nor a Control")
        except Exception as exc:
            reply = error_reply(DRAFT, exc)
        reply.compute_s, reply.ahead_s, self.ahead_s = time.perf_counter() - t0, self.ahead_s, 0.0
        return reply

    def _control(self, ctl: Control) -> Reply:
        if self.load_error is not None:  # every request learns why the worker cannot draft
            return error_reply(READY if ctl.op == HELLO else ACK, self.load_error)
        if ctl.op == HELLO:
            runner = self.drafter.runner  # (Drafter.runner: None for a model-free drafter)
            context = runner.max_context if isinstance(runner, Runner) else 0
            return Reply(OK, READY, Control(READY, self.options.target_vocab, [context]).pack())
        if ctl.op == BEGIN:
            sampler = sampler_from_words(ctl.words)
            self.drafter.begin(ctl.arg, sampler)
            greedy = sampler is None and self.options.mode == "async"
            self.ahead = Lookahead(self.drafter, ctl.arg, self.options.lookahead, self.step) if greedy else None
            return Reply(OK, ACK)
        if ctl.op == RESET:
            self.drafter.reset()
            self.ahead = None
            return Reply(OK, ACK)
        raise ValueError(f"unknown control op {ctl.op}")

    def _draft(self, req: DraftRequest) -> Reply:
        if self.load_error is not None:
            return error_reply(DRAFT, self.load_error)
        if self.ahead is not None:
            tokens, source = self.ahead.answer(req)
            return Reply(OK, DRAFT, DraftResult(req.seq_id, tokens).pack(), source)
        rnd = Round()
        result = self.drafter.draft(req, rnd)
        # (drafted ahead, a catch-up was paid between requests, not in the engine's wait: 0 there)
        return Reply(OK, DRAFT, DraftResult(req.seq_id, result.tokens).pack(), FRESH, probs=result.probs,
                     catch_up_s=rnd.catch_up_s)

    def work_ahead(self) -> None:
        """One step of drafting ahead (between requests)."""
        t0 = time.perf_counter()
        try:
            self.ahead.extend(self.ahead.bound)
        except Exception:  # a failing guess costs nothing: the next request drafts fresh
            self.ahead.bound = 0
        self.ahead_s += time.perf_counter() - t0

    @property
    def has_work(self) -> bool:
        return self.ahead is not None and self.ahead.pending


def _setup(options: WorkerOptions) -> None:
    """A worker process's setup: the engine's cache folder, its threads and CPUs. Its
    backends' switches come with its spec (ModelSpec.options), not its environment."""
    from hetero_sd.ir.cache import use_root

    use_root(options.cache)
    if options.threads:  # for the third-party runtimes (OpenMP, torch), not our config
        os.environ["OMP_NUM_THREADS"] = str(options.threads)
        import torch

        torch.set_num_threads(options.threads)
    from hetero_sd.transport.serve import pin_to_cpu

    pin_to_cpu(options.cpu)


def main(spec: DrafterSpec, address, options: WorkerOptions, *, build: Callable, in_process: bool = False,
         handler_type: type = Handler) -> None:
    """Worker body (a process target; `in_process`: a thread of the engine's process).
    `build(spec, target_vocab)` makes the drafter; a `handler_type` instance answers requests."""
    if not in_process:
        _setup(options)
    channel, handler = connect(address), None
    try:
        try:
            drafter, error = build(spec, options.target_vocab), None
        except Exception as exc:
            drafter, error = None, exc
        handler = handler_type(channel, drafter, error, options, spec)
        while True:
            try:
                # A bounded idle wait, not None: after a zero-timeout poll a TCP socket
                # stays non-blocking when recv is given no timeout.
                msg = channel.recv(0 if handler.has_work else IDLE_WAIT_S)
            except TransportTimeout:
                if handler.has_work:
                    handler.work_ahead()
                continue
            channel.send(handler(msg), timeout=30.0)
    except PeerClosed:
        pass  # the engine closed the channel (or died): nothing left to do
    finally:
        if handler is not None:
            handler.close()
        channel.close()


__all__ = ["Handler", "Lookahead", "main"]
