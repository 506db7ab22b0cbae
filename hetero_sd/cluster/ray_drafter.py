"""A RemoteDrafter's worker as a Ray actor, possibly on another machine.

The actor answers the same records as a worker process (drafting/wire.py),
through the same Handler: each request is one actor call whose argument is
the packed record and whose two results are the reply frame and, under
sampling, the draft distributions as a float64 numpy array in Ray's object
store (zero-copy on the engine's node; Ray moves it across nodes). In async
mode a thread of the actor drafts ahead between calls, one model step at a
time, as the worker loop does between records.

A dead actor, node or raylet turns into PeerClosed on the engine's channel,
a hung one into TransportTimeout: RemoteDrafter then drops the worker and
starts a fresh actor at the next request, as it does for a local worker.
"""
from __future__ import annotations

import os
import threading
import time
from collections import deque

import numpy as np

from hetero_sd.cluster.link import probe_reply
from hetero_sd.cluster.placement import RayPlacement
from hetero_sd.cluster.ray_env import actor_failure, actor_options, check_placeable, connect
from hetero_sd.drafting.wire import encode_reply
from hetero_sd.transport.base import Transport
from hetero_sd.transport.errors import PeerClosed, TransportError, TransportTimeout


FETCH_TIMEOUT_S = 60.0  # a reply whose frame is ready but whose distributions do not arrive


class _Beside:
    """The actor's side of encode_reply: no arena, distributions go beside the frame."""

    tx_arena = None


class DrafterActor:
    """The actor body (wrapped by ray.remote when started): a Handler, and a
    thread that drafts ahead while no call is being answered."""

    def __init__(self, spec, options, build):
        from hetero_sd.drafting import worker

        worker._setup(options)  # cache folder, threads and CPUs, as a worker process
        try:
            drafter, error = build(spec, options.target_vocab), None
        except Exception as exc:  # every request learns why (HELLO answers with it)
            drafter, error = None, exc
        self.handler = worker.Handler(_Beside, drafter, error, options, spec)
        self.cond = threading.Condition()
        self.waiting = 0  # calls waiting for the lock: the ahead thread lets them in first
        threading.Thread(target=self._ahead, daemon=True, name="hsd-ahead").start()

    def call(self, msg: bytes):
        self.waiting += 1
        with self.cond:
            self.waiting -= 1
            reply = self.handler.reply(msg)
            self.cond.notify()
        probs, reply.probs = reply.probs, None
        if probs is not None:  # the wire's type, as encode_reply makes it for the other transports
            probs = np.ascontiguousarray(probs, dtype=np.float64)
        return encode_reply(_Beside, reply), probs

    def _ahead(self) -> None:
        while True:
            while self.waiting:
                time.sleep(1e-4)
            with self.cond:  # a daemon thread: it ends with the actor's process
                self.cond.wait_for(lambda: self.handler.has_work)
                self.handler.work_ahead()

    def where(self) -> str:
        import ray

        ctx = ray.get_runtime_context()
        return f"node {ctx.get_node_id()[:8]} pid {os.getpid()}"

    def pid(self) -> int:
        return os.getpid()

    def probe(self, record: bytes, rows: int, vocab: int):
        """The link's cost (cluster/link.py): the record back, and a rows x vocab float64 block."""
        return probe_reply(record, rows, vocab)

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()


class RayChannel(Transport):
    """The engine's end: send() makes the actor call, recv() waits for its result."""

    kind = "ray"

    def __init__(self, actor):
        import ray

        self.ray, self.actor = ray, actor
        self._pending: deque = deque()
        self._side = None
        self.dead = self.closed = False

    def send(self, record: bytes, timeout: float | None = None) -> None:
        if self.dead or self.closed:
            raise PeerClosed("the drafter's Ray actor is gone")
        self._pending.append(self.actor.call.options(num_returns=2).remote(bytes(record)))

    def recv(self, timeout: float | None = None) -> bytes:
        if not self._pending:
            raise TransportError("recv on a Ray channel with no call in flight")
        frame_ref, probs_ref = self._pending[0]
        ready, _ = self.ray.wait([frame_ref], timeout=timeout)
        if not ready:
            raise TransportTimeout(f"no reply within {timeout:.3g} s")
        self._pending.popleft()
        try:  # the distributions may still be crossing from another node: a bound of their own
            frame, self._side = self.ray.get([frame_ref, probs_ref], timeout=FETCH_TIMEOUT_S)
        except self.ray.exceptions.GetTimeoutError:
            self.dead = True  # a call is lost half-read: this channel cannot go on
            raise TransportTimeout(f"the reply's distributions did not arrive within {FETCH_TIMEOUT_S:g} s") from None
        except self.ray.exceptions.RayError as exc:  # the actor, its node or the object is gone
            self.dead = True
            what = "died" if actor_failure(exc) else "lost its reply"
            raise PeerClosed(f"the drafter's Ray actor {what}: {type(exc).__name__}: {str(exc)[:500]}") from None
        return frame

    def take_tensor(self):
        side, self._side = self._side, None
        return side

    def close(self) -> None:
        self.closed = True
        self._pending.clear()


class RayWorker:
    """What RemoteDrafter holds for a started worker (remote._Worker's interface),
    here one Ray actor placed by a RayPlacement."""

    held = None  # no arena region to release

    def __init__(self, spec, options, placement: RayPlacement, name: str, build):
        """`build(spec, target_vocab)` makes the drafter in the actor (drafting.build.build_drafter)."""
        ray = connect(placement)
        check_placeable(placement, f"drafter {name}")
        self.actor = ray.remote(DrafterActor).options(**actor_options(placement)).remote(spec, options, build)
        self.channel = RayChannel(self.actor)
        self.proc = self  # RemoteDrafter reads proc.exitcode of a dead worker
        self.exitcode = None
        self._pid: int | None = None

    @property
    def pid(self) -> int | None:
        """The actor's process id (on its node); asks the actor once."""
        if self._pid is None and not self.channel.dead:
            try:
                self._pid = self.channel.ray.get(self.actor.pid.remote(), timeout=60)
            except Exception:
                return None
        return self._pid

    def alive(self) -> bool:
        return not (self.channel.dead or self.channel.closed)

    def stop(self, kill: bool = False) -> None:
        self.channel.close()
        try:
            self.channel.ray.kill(self.actor, no_restart=True)
        except Exception:  # already gone with its node
            pass

    def release(self) -> None:
        pass


__all__ = ["DrafterActor", "RayChannel", "RayWorker"]
