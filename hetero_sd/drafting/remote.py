"""Drafters in their own processes, supervised by the engine.

    drafter = build_drafter(WorkerSpec(ModelSpec("/m/draft.gguf", "onnxruntime", "cpu", "int4"),
                                       transport="shm", mode="async"), target.vocab_size)
    drafter.wait_ready()              # the worker has loaded its model (raises why it could not)
    engine = Engine(target, drafter, k=5)

A RemoteDrafter is a Drafter: begin / draft / reset become requests to a
worker process (worker.py) over a transport (shm, tcp, pipe; "inproc" runs
the worker loop in a thread of this process, for tests), or in a Ray actor
placed on a node of a cluster (transport "ray": hetero_sd/cluster). The wire format is
in wire.py: work-IR records, no pickling after start. `entry` is the
process's target, `worker_entry()` of build.py (a test may pass its own, to
inject faults from outside).

Sampling: at begin the request's draft random stream moves to the worker
(its exact PCG64 state), so the worker draws what an in-process drafter would;
the engine's copy jumps ahead to an independent stream in case a fallback
drafter takes over. Draft distributions come back through the shm arena as a
zero-copy view (inline over tcp / pipe), valid until the next call.

Fault tolerance. A worker that dies (kill -9), hangs past `timeout_s`
(`start_timeout_s` for its start and first draft, which include model load
and warm-up), or answers with a malformed or error reply makes the call
raise WorkerError (or the transport's error); before raising, the worker is
killed if alive and the channel closed, which unlinks its shared-memory
segment. The engine then drops the drafter for that request (the output
does not change). Rows in CUDA IPC buffers whose worker died raise
planes.IpcOwnerGone (a TransportError), which is such a failure too. The
next begin() starts a fresh worker (its model loads again); after
`max_failed_starts` failed starts in a row, begin keeps failing.

Data plane (`data_plane`, transport/planes.py): auto puts the rows of a
drafter on a CUDA device in CUDA IPC buffers (shm transport, torch sees CUDA),
everything else in the shm arena.

Asynchronous mode (`mode="async"`): the worker drafts ahead between requests
(worker.py); greedy requests only, a sampled request runs synchronously.
`stats` counts the rounds served from pre-drafted tokens.
"""
from __future__ import annotations

import multiprocessing
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable

import numpy as np

from hetero_sd.drafting.base import Drafter
from hetero_sd.drafting.specs import MODES, TRANSPORTS, DrafterSpec, device_list, has_distributions
from hetero_sd.drafting.wire import (ACK, AHEAD, BEGIN, DRAFT, ERROR, HELLO, PARTIAL, READY, RESET, Control,
                                     decode_reply, parse_draft, sampling_words)
from hetero_sd.drafting.worker import WorkerOptions
from hetero_sd.ir.cache import configured_root
from hetero_sd.ir.errors import BackendError, ConfigError, from_text
from hetero_sd.ir.work import MAX_DRAFT_TOKENS, DraftRequest, DraftResult
from hetero_sd.transport import CorruptRecord, TransportTimeout, listen, planes

START_METHODS = ("forkserver", "spawn")


class WorkerError(BackendError):
    """A drafter worker died, hung, or answered with an error or a malformed record."""


@dataclass
class WorkerStats:
    starts: int = 0  # worker processes started (restarts included)
    failures: int = 0  # workers lost to a death, hang, error or malformed reply
    rounds: int = 0  # draft replies received
    fresh: int = 0  # drafted on request
    partial: int = 0  # async: part pre-drafted, the rest drafted on request
    ahead: int = 0  # async: served entirely from pre-drafted tokens
    wait_s: float = 0.0  # engine side: request sent -> reply read, summed over draft calls
    compute_s: float = 0.0  # worker side: drafting for those replies
    ahead_s: float = 0.0  # worker side: drafting ahead between requests (overlaps verification)
    last_error: str = ""


def _stop(proc, channel, kill: bool) -> None:
    """Stop one worker: close the channel (the worker exits on PeerClosed), kill it
    if it does not go (or at once, for a hung or misbehaving one), reap it."""
    if kill and isinstance(proc, multiprocessing.process.BaseProcess) and proc.is_alive():
        proc.kill()
    try:
        channel.close()
    finally:
        if isinstance(proc, multiprocessing.process.BaseProcess):
            proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)


class _Worker:
    """One started worker: its process (or thread) and the engine's end of the channel."""

    def __init__(self, entry: Callable, spec: DrafterSpec, options: WorkerOptions, transport: str,
                 start_method: str):
        arena = has_distributions(spec) and transport == "shm"
        kind = options.data_plane  # host: rows in the arena; a device plane: its control words only
        self.channel = listen(transport, **(planes.channel_options(kind, options.target_vocab, MAX_DRAFT_TOKENS)
                                            if arena else {}))
        self.plane = planes.reader_for(self.channel, kind) if arena else None
        try:
            if transport == "inproc":
                self.proc = threading.Thread(target=entry, args=(spec, self.channel.address, options),
                                             kwargs={"in_process": True}, daemon=True, name="hsd-drafter")
            else:
                ctx = multiprocessing.get_context(start_method)
                if start_method == "forkserver":  # workers fork from a server with these imported
                    ctx.set_forkserver_preload(["hetero_sd.drafting.build"])
                self.proc = ctx.Process(target=entry, args=(spec, self.channel.address, options),
                                        daemon=True, name="hsd-drafter")
            self.proc.start()
            self.channel.handed_over()
        except BaseException:
            self.channel.close()
            raise
        self.pid = getattr(self.proc, "pid", None)
        self._finalizer = weakref.finalize(self, _stop, self.proc, self.channel, True)
        self.held: int | None = None  # the arena region the last reply's distributions sit in

    def alive(self) -> bool:
        return self.proc.is_alive()

    def stop(self, kill: bool = False) -> None:
        if self._finalizer.alive:
            self._finalizer.detach()
            _stop(self.proc, self.channel, kill)
            if self.plane is not None:
                self.plane.close()

    def release(self) -> None:
        if self.held is not None:
            region, self.held = self.held, None
            self.plane.release(region)


class RemoteDrafter(Drafter):
    """A Drafter whose drafter runs in a worker process (module docstring)."""

    def __init__(self, spec: DrafterSpec, target_vocab: int, *, entry: Callable, transport: str = "shm",
                 mode: str = "sync", timeout_s: float = 5.0, start_timeout_s: float = 300.0,
                 lookahead: int | None = None, threads: int | None = None,
                 cpu: int | tuple[int, ...] | None = None,
                 start_method: str = "forkserver", max_failed_starts: int = 3, start: bool = True,
                 ray=None, data_plane: str = "auto"):
        for value, allowed, what in ((transport, TRANSPORTS, "transport"), (mode, MODES, "mode"),
                                     (start_method, START_METHODS, "start_method")):
            if value not in allowed:
                raise ConfigError(f"worker {what} {value!r} is not one of {', '.join(allowed)}")
        if timeout_s <= 0 or start_timeout_s <= 0:
            raise ConfigError(f"worker timeouts must be positive, got {timeout_s} and {start_timeout_s}")
        self.entry, self.spec, self.transport, self.mode = entry, spec, transport, mode
        self.placement = ray  # transport "ray": a cluster.RayPlacement (None: any node of the cluster)
        self.start_method = start_method
        self.vocab, self.timeout_s, self.start_timeout_s = target_vocab, timeout_s, start_timeout_s
        self.max_failed_starts = max_failed_starts
        self.options = WorkerOptions(target_vocab, mode, lookahead, threads, cpu, configured_root(),
                                     *planes.resolve(data_plane, device_list(spec), transport))
        self.name = f"{spec.label}@{transport}" + ("-async" if mode == "async" else "")
        self.one_hot = not spec.has_distributions  # (Drafter.one_hot: as its drafter's are)
        self.stats = WorkerStats()
        self._w: _Worker | None = None
        self._ready = self._warm = False
        self._failed_starts = 0
        # CPUs the engine's process gave up to this worker (build.split_cores): back on close,
        # or whatever the process runs next (a benchmark's next configuration) has fewer
        self.restore_affinity: set[int] | None = None
        if start:
            self.start()

    # ------------------------------------------------------------ lifecycle
    @property
    def pid(self) -> int | None:
        """The worker process's pid (None for a thread worker or none started)."""
        return None if self._w is None else self._w.pid

    def start(self) -> None:
        """Start a worker (returns at once; wait_ready() waits for its model)."""
        self._stop_worker()
        if self.transport == "ray":  # an actor, possibly on another machine
            from hetero_sd.cluster import RayPlacement
            from hetero_sd.cluster.ray_drafter import RayWorker

            # the actor runs the worker's Handler with the entry's build function (worker_entry())
            build = getattr(self.entry, "keywords", {}).get("build")
            if build is None:
                raise ConfigError("transport 'ray' needs a worker entry that names its build function "
                                  "(drafting.build.worker_entry())")
            self._w = RayWorker(self.spec, self.options, self.placement or RayPlacement(), self.name, build)
        else:
            self._w = _Worker(self.entry, self.spec, self.options, self.transport, self.start_method)
        self._ready = self._warm = False
        self.stats.starts += 1

    @property
    def draft_device(self) -> str:
        """Where it computes, as the overlap compares devices (the splitter's DraftOption.device):
        a worker on the CPU has cores of its own; one on an accelerator shares that device."""
        devices = device_list(self.spec)
        where = devices[-1] if devices else "cpu"
        return "worker:cpu" if where.lower() == "cpu" else where

    def wait_ready(self) -> None:
        """Block until the worker has built its drafter; raise what stopped it
        (the worker's ConfigError / ModelLoadError / BackendError as such)."""
        if self._w is None:
            self.start()
        if self._ready:
            return
        try:
            self._call(Control(HELLO).pack(), READY, self.start_timeout_s)
        except BaseException:
            self._failed_starts += 1
            raise
        self._ready, self._failed_starts = True, 0

    def close(self) -> None:
        """Stop the worker (closing the channel unlinks its segment), and give back a
        Ray placement group it was placed in. Idempotent."""
        self._stop_worker()
        if self.restore_affinity is not None:
            os.sched_setaffinity(0, self.restore_affinity)
            self.restore_affinity = None
        if self.placement is not None and self.placement.group:
            from hetero_sd.cluster.ray_env import release_group

            release_group(self.placement.group)

    def _stop_worker(self) -> None:
        if self._w is not None:
            w, self._w = self._w, None
            w.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------ the Drafter protocol
    def begin(self, capacity: int, sampler=None, guide=None) -> None:
        # guide: not sent (the grammar lives in this process); the engine cuts refused drafts
        words = sampling_words(sampler)
        idle_worker = self._w is not None and self._ready
        try:
            self._begin(capacity, words)
        except Exception:
            if not idle_worker:
                raise
            # The worker was ready at the end of the last request and died (or broke)
            # since, while idle: a fresh one costs a start, not this request's drafts.
            self._begin(capacity, words)
        if sampler is not None:  # the worker now owns the draft stream; ours moves on
            sampler.draft_rng = np.random.Generator(sampler.draft_rng.bit_generator.jumped())

    def _begin(self, capacity: int, words: list[int]) -> None:
        if self._w is None or not self._w.alive():
            if self._failed_starts >= self.max_failed_starts:
                raise WorkerError(f"drafter worker {self.name} failed to start {self._failed_starts} times "
                                  f"in a row; last error: {self.stats.last_error}")
            self.start()
        self.wait_ready()
        self._w.release()
        self._call(Control(BEGIN, capacity, words).pack(), ACK, self._timeout())

    def draft(self, req: DraftRequest, rnd=None) -> DraftResult:
        if self._w is None or not self._ready:
            raise WorkerError(f"drafter worker {self.name} is not running (it failed earlier)")
        self._w.release()  # the previous reply's distributions are no longer read
        t0 = time.perf_counter()
        reply = self._call(req.pack(), DRAFT, self._timeout())
        try:
            result = parse_draft(reply, req.seq_id, req.k, self.vocab, rnd)
        except CorruptRecord as exc:
            self._fail(exc)
            raise
        st = self.stats
        st.wait_s += time.perf_counter() - t0
        st.compute_s, st.ahead_s, st.rounds = st.compute_s + reply.compute_s, st.ahead_s + reply.ahead_s, st.rounds + 1
        if reply.source == AHEAD:
            st.ahead += 1
        elif reply.source == PARTIAL:
            st.partial += 1
        else:
            st.fresh += 1
        self._warm = True
        return result

    def reset(self) -> None:
        """Forget the sequence; never raises (a failure here marks the worker failed)."""
        if self._w is None or not self._ready or not self._w.alive():
            return
        try:
            self._w.release()
            self._call(Control(RESET).pack(), ACK, self._timeout())
        except Exception:
            pass

    # ------------------------------------------------------------ one exchange
    def _timeout(self) -> float:
        return self.timeout_s if self._warm else self.start_timeout_s

    def _call(self, request: bytes, answers: int, timeout: float):
        """Send one request, read its reply; on any failure stop the worker and raise."""
        w, deadline = self._w, time.monotonic() + timeout
        try:
            if self.transport == "tcp":  # the worker connects after it started: wait in slices
                self._sliced(w, deadline, w.channel.accept)
            w.channel.send(request, timeout)
            if self.transport == "tcp":  # a timed-out TCP read may split a frame: one wait
                frame = self._sliced(w, deadline, w.channel.recv, slice_s=None)
            else:
                frame = self._sliced(w, deadline, w.channel.recv)
            plane = w.plane if isinstance(w, _Worker) else None  # (a Ray actor's rows come beside the frame)
            reply = decode_reply(w.channel, frame, self.vocab, plane)
            w.held = reply.region
            if reply.status == ERROR:
                raise from_text(reply.body.decode(errors="replace"), f"drafter worker {self.name}", WorkerError)
            if reply.answers != answers:
                raise CorruptRecord(f"worker answered op {reply.answers}, expected {answers}")
            return reply
        except Exception as exc:
            self._fail(exc)
            raise

    def _sliced(self, w: _Worker, deadline: float, wait, slice_s: float | None = 0.5):
        """wait(timeout) in slices until it returns, so a worker that dies before it
        has even connected is noticed (shared memory checks the peer's pid only
        once it attached; sockets see EOF only once connected)."""
        while True:
            left = max(0.0, deadline - time.monotonic())
            try:
                return wait(left if slice_s is None else min(left, slice_s))
            except TransportTimeout:
                if not w.alive():
                    raise WorkerError(f"drafter worker {self.name} exited "
                                      f"(code {getattr(w.proc, 'exitcode', None)})") from None
                if time.monotonic() >= deadline:
                    raise TransportTimeout(f"drafter worker {self.name} did not answer within "
                                           f"{self._timeout():g} s; it was stopped") from None

    def _fail(self, exc: BaseException) -> None:
        self.stats.failures += 1
        self.stats.last_error = f"{type(exc).__name__}: {exc}"[:300]
        if self._w is not None:
            w, self._w = self._w, None
            w.stop(kill=True)
        self._ready = self._warm = False


__all__ = ["RemoteDrafter", "WorkerError", "WorkerStats"]
