"""The Transport interface and the in-process implementation.

A transport is one end of a channel: two directions, each carrying whole
records (bytes: a packed work-IR record, optionally framed with tensor refs by
arena.pack_frame) in order, once. `send` may block while the peer's buffer is
full; `recv` blocks until a record arrives. Both take a timeout in seconds
(None: no limit; 0: do not wait) and raise TransportTimeout when it passes, and
PeerClosed when the other end closed or died.
"""
from __future__ import annotations

import itertools
import threading
from collections import deque

from hetero_sd.transport.errors import PeerClosed, TransportError, TransportTimeout


class Transport:
    """One end of a channel. Subclasses set `kind` and implement the three calls."""

    kind = "abstract"
    max_record: int | None = None  # the largest record accepted, None when unbounded
    tx_arena = rx_arena = None     # shared tensor arenas (shared memory only)

    def send(self, record: bytes, timeout: float | None = None) -> None:
        raise NotImplementedError

    def recv(self, timeout: float | None = None) -> bytes:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def take_tensor(self):
        """A tensor that arrived beside the last record received, outside its
        bytes (a Ray actor's reply, through the object store), once; None on
        transports that carry tensors in the record or an arena."""
        return None

    def handed_over(self) -> None:
        """Server side: the peer process has started with its copy of `address`.
        (Pipes close the parent's copy of the child's end here, so a dead child
        reads as EOF; the others need nothing.)"""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class _Pipe:
    """One direction: a deque, and a condition for a receiver in another thread."""

    def __init__(self):
        self.items: deque[bytes] = deque()
        self.cond = threading.Condition(threading.Lock())
        self.closed = False


class InProcTransport(Transport):
    """Today's path: both ends in one process. Records are still bytes (not
    objects), so code written against it runs unchanged over the others."""

    kind = "inproc"
    _registry: dict[str, "InProcTransport"] = {}
    _ids = itertools.count()

    def __init__(self, rx: _Pipe, tx: _Pipe, address: str | None = None):
        self._rx, self._tx, self.address = rx, tx, address

    @classmethod
    def listen(cls) -> "InProcTransport":
        a, b = _Pipe(), _Pipe()
        address = f"inproc://{next(cls._ids)}"
        cls._registry[address] = cls(a, b)  # the client end, waiting for connect()
        return cls(b, a, address)

    @classmethod
    def connect(cls, address: str) -> "InProcTransport":
        try:
            return cls._registry.pop(address)
        except KeyError:
            raise TransportError(f"no in-process channel {address!r} waiting for a client "
                                 "(in-process channels do not cross processes)") from None

    def send(self, record: bytes, timeout: float | None = None) -> None:
        tx = self._tx
        with tx.cond:
            if tx.closed:
                raise PeerClosed("the in-process channel was closed")
            tx.items.append(bytes(record))
            tx.cond.notify()

    def recv(self, timeout: float | None = None) -> bytes:
        rx = self._rx
        with rx.cond:
            if not rx.items and not rx.closed:
                rx.cond.wait_for(lambda: rx.items or rx.closed, timeout)
            if rx.items:
                return rx.items.popleft()
            if rx.closed:
                raise PeerClosed("the in-process channel was closed")
            raise TransportTimeout(f"no record within {timeout:.3g} s")

    def close(self) -> None:
        for p in (self._rx, self._tx):
            with p.cond:
                p.closed = True
                p.cond.notify_all()
        if self.address is not None:
            self._registry.pop(self.address, None)
