"""Child-process bodies for the transport tests (spawned: they must be importable
by module name, which test modules under --import-mode=importlib are not)."""
from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

from hetero_sd.transport import PeerClosed, connect, pack_frame, unpack_frame
from hetero_sd.transport.segment import Segment


def numbered_stream(address, count: int) -> None:
    """Send `count` records whose content depends on their number, then wait for
    the server's goodbye (so the channel is not closed under unread data)."""
    with connect(address) as ch:
        for i in range(count):
            ch.send(record_for(i), timeout=30)
        ch.recv(timeout=60)


def record_for(i: int) -> bytes:
    # Sizes cycle 0..699 bytes: single- and multi-slot records, empty ones too.
    return i.to_bytes(4, "little") * ((i * 37) % 700 // 4) + bytes(i % 4)


def arena_producer(address, rows: int, vocab: int, rounds: int) -> None:
    """Per request: claim a region, write rows of (round + row index) in place,
    send the ref; the server checks the values from its zero-copy view."""
    with connect(address) as ch:
        arena = ch.tx_arena
        for r in range(rounds):
            ch.recv(timeout=30)
            lease = arena.claim(timeout=30)
            ref, view = lease.alloc((rows, vocab), np.float32)
            view[:] = np.arange(rows, dtype=np.float32)[:, None] + r
            ch.send(pack_frame(b"probs", [ref]), timeout=30)
        ch.recv(timeout=60)


def attach_and_report(name: str, conn) -> None:
    """Attach to a raw segment, write a byte, report, exit normally."""
    seg = Segment.attach(name)
    seg.buf[0] = 7
    conn.send("attached")
    seg.close()


def attach_then_hang(address, conn) -> None:
    """Attach, say so, and hang (the test kills us with SIGKILL)."""
    ch = connect(address)
    conn.send(os.getpid())
    time.sleep(600)
    ch.close()


def create_then_hang(conn) -> None:
    """Create a channel, report its segment name, and hang until SIGKILLed."""
    from hetero_sd.transport import listen

    ch = listen("shm")
    conn.send(ch.name)
    time.sleep(600)


def echo_until_closed(address) -> None:
    with connect(address) as ch:
        try:
            while True:
                ch.send(ch.recv(timeout=60))
        except PeerClosed:
            pass


def kill_self_after(address, n: int) -> None:
    """Echo n records, then die without closing anything."""
    ch = connect(address)
    for _ in range(n):
        ch.send(ch.recv(timeout=60))
    os.kill(os.getpid(), signal.SIGKILL)


def frame_echo_refs(address) -> None:
    """Echo the refs of one frame back (unused tensors)."""
    with connect(address) as ch:
        rec, refs = unpack_frame(ch.recv(timeout=30))
        ch.send(pack_frame(rec, refs))
        ch.recv(timeout=60)


if __name__ == "__main__":  # pragma: no cover - not a script
    sys.exit(1)
