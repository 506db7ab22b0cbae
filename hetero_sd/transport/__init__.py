"""Transports that carry work-IR records between the engine and a worker process.

    from hetero_sd.transport import listen, connect
    server = listen("shm")                    # in the engine: creates the channel
    proc = ctx.Process(target=worker, args=(server.address,)); proc.start()
    server.handed_over()
    server.send(DraftRequest(...).pack()); DraftResult.unpack(server.recv(timeout=1.0))

    def worker(address):                      # in the child (fork or spawn)
        with connect(address) as ch:
            while True:
                ch.send(handle(ch.recv()))

Kinds: "inproc" (a deque; both ends in one process), "shm" (rings in POSIX
shared memory, plus tensor arenas), "tcp" (loopback or remote) and "pipe"
(multiprocessing.Pipe). Addresses are strings ("shm://NAME",
"tcp://HOST:PORT/TOKEN", "inproc://N") except a pipe's, which is the child's
Connection object (pass it to the child as a Process argument).
"""
from __future__ import annotations

from hetero_sd.transport.arena import Arena, Lease, TensorRef, pack_frame, unpack_frame
from hetero_sd.transport.base import InProcTransport, Transport
from hetero_sd.transport.errors import (
    CorruptRecord,
    PeerClosed,
    RecordTooLarge,
    TransportError,
    TransportTimeout,
)
from hetero_sd.transport.segment import cleanup_stale
from hetero_sd.transport.sockets import PipeTransport, TcpTransport

KINDS = ("inproc", "shm", "tcp", "pipe")

__all__ = ["KINDS", "Arena", "CorruptRecord", "InProcTransport", "Lease", "PeerClosed",
           "PipeTransport", "RecordTooLarge", "TcpTransport", "TensorRef", "Transport",
           "TransportError", "TransportTimeout", "cleanup_stale", "connect", "listen",
           "pack_frame", "unpack_frame"]


def listen(kind: str, **options) -> Transport:
    """The server end of a new channel of `kind`; hand `.address` to the peer.

    Options: shm: n_slots, slot_size, arena_regions, arena_region_bytes,
    spin_us, check_interval; tcp: host, port."""
    if kind == "shm":
        from hetero_sd.transport.shm import ShmTransport
        return ShmTransport.create(**options)
    if kind == "tcp":
        return TcpTransport.listen(**options)
    if kind == "pipe":
        return PipeTransport.listen(**options)
    if kind == "inproc":
        return InProcTransport.listen(**options)
    raise TransportError(f"unknown transport {kind!r}; choose one of {', '.join(KINDS)}")


def connect(address, **options) -> Transport:
    """The client end of the channel at `address` (from the server's `.address`)."""
    if not isinstance(address, str):  # a multiprocessing Connection: the pipe's child end
        return PipeTransport(address)
    kind = address.split("://", 1)[0]
    if kind == "shm":
        from hetero_sd.transport.shm import ShmTransport
        return ShmTransport.attach(address.removeprefix("shm://"), **options)
    if kind == "tcp":
        return TcpTransport.connect(address, **options)
    if kind == "inproc":
        return InProcTransport.connect(address)
    raise TransportError(f"{address!r} is not a transport address "
                         "(shm://NAME, tcp://HOST:PORT/TOKEN or inproc://N)")
