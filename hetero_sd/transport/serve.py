"""The worker side's loop: receive a record, answer it, until the channel closes.

A drafter worker is `serve(address, handler)` with a handler that unpacks a
DraftRequest, drafts, and packs a DraftResult. Process supervision (start,
restart, kill on hang) is the engine's; this only runs the loop.
"""
from __future__ import annotations

import os
from typing import Callable

from hetero_sd.transport.errors import PeerClosed


def pin_to_cpu(cpu) -> bool:
    """Pin this process to one CPU or a set of them (Linux); False when not
    possible. Two processes spinning on one core is what makes the ~125 us
    wake-up mode."""
    if cpu is None or not hasattr(os, "sched_setaffinity"):
        return False
    cpus = {cpu} if isinstance(cpu, int) else set(cpu)
    try:
        if not cpus <= os.sched_getaffinity(0):
            return False
        os.sched_setaffinity(0, cpus)
        return True
    except OSError:
        return False


def echo(record: bytes) -> bytes:
    return record


def serve(address, handler: Callable[[bytes], bytes] = echo, *, cpu: int | None = None,
          idle_timeout: float | None = None, **connect_options) -> int:
    """Answer records on the channel at `address` until the server closes it;
    returns how many were answered. `idle_timeout` bounds each wait (raises
    TransportTimeout), so a worker whose engine hung does not live forever."""
    from hetero_sd.transport import connect

    pin_to_cpu(cpu)
    served = 0
    with connect(address, **connect_options) as channel:
        try:
            while True:
                channel.send(handler(channel.recv(idle_timeout)), idle_timeout)
                served += 1
        except PeerClosed:
            return served
