"""The shared-memory channel: one segment, two rings, two optional arenas.

    segment = header | ring server->client | ring client->server
                     | arena written by the server | arena written by the client

The server (`ShmTransport.create`) owns the segment and is the only side that
unlinks it; the client (`ShmTransport.attach(name)`, typically in a worker
process started by fork or spawn) maps it by name and writes its pid into the
header, so each side can tell when the other died without closing (kill -9):
a wait that has slept a whole `check_interval` checks the peer's pid and
raises PeerClosed. Both pids are compared only when the two ends share a pid
namespace (recorded in the header); across containers, rely on timeouts.
"""
from __future__ import annotations

import os
import struct

from hetero_sd.transport.arena import Arena, arena_bytes
from hetero_sd.transport.base import Transport
from hetero_sd.transport.errors import PeerClosed, TransportError
from hetero_sd.transport.ring import Ring, ring_bytes
from hetero_sd.transport.segment import Segment, pid_alive, pid_namespace

MAGIC, VERSION = 0x43445348, 1  # "HSDC"
HEADER = struct.Struct("<IIIIQIIIIQ")  # magic, version, server pid, client pid, pidns,
#                                       n_slots, slot_size, ring bytes, n_regions, region bytes
HEADER_BYTES = 4096  # rings and arenas start page-aligned
_CLIENT_PID_AT = 12


def _layout(n_slots: int, slot_size: int, n_regions: int, region_bytes: int) -> list[int]:
    """Offsets of ring s->c, ring c->s, arena s->c, arena c->s, and the total."""
    ring = -(-ring_bytes(n_slots, slot_size) // 4096) * 4096
    arena = arena_bytes(n_regions, region_bytes)
    offs = [HEADER_BYTES, HEADER_BYTES + ring, HEADER_BYTES + 2 * ring, HEADER_BYTES + 2 * ring + arena]
    return offs + [offs[3] + arena]


class ShmTransport(Transport):
    """One end of a shared-memory channel (see the module docstring)."""

    kind = "shm"

    def __init__(self, segment: Segment, server: bool, spin_us: float, check_interval: float):
        self._segment, self.server = segment, server
        buf = segment.buf
        (magic, version, spid, cpid, ns, n_slots, slot_size, _, n_regions,
         region_bytes) = HEADER.unpack_from(buf, 0)
        if magic != MAGIC or version != VERSION:
            raise TransportError(f"segment {segment.name!r} is not a hetero-sd channel "
                                 f"(magic {magic:#x} version {version})")
        offs = _layout(n_slots, slot_size, n_regions, region_bytes)
        if len(buf) < offs[4]:
            raise TransportError(f"segment {segment.name!r} is smaller than its header says")
        self._same_ns = ns == pid_namespace()
        kw = dict(spin_us=spin_us, check_interval=check_interval, on_idle=self._check_peer)
        s2c, c2s = (Ring(buf[offs[i]:offs[i + 1]], **kw) for i in (0, 1))
        self._tx, self._rx = (s2c, c2s) if server else (c2s, s2c)
        self.max_record = self._tx.max_record
        if n_regions:
            a_s, a_c = (Arena(buf[offs[i]:offs[i + 1]], **kw) for i in (2, 3))
            self.tx_arena, self.rx_arena = (a_s, a_c) if server else (a_c, a_s)
        self._closed = False

    @classmethod
    def create(cls, *, n_slots: int = 1024, slot_size: int = 256, arena_regions: int = 0,
               arena_region_bytes: int = 0, spin_us: float = 50.0,
               check_interval: float = 0.1) -> "ShmTransport":
        """The server end: a new 0600 segment with both rings (and arenas, when
        arena_regions > 0: each direction gets arena_regions x arena_region_bytes)."""
        offs = _layout(n_slots, slot_size, arena_regions, arena_region_bytes)
        seg = Segment.create(offs[4])
        try:
            buf = seg.buf
            for i in (0, 1):
                Ring.init(buf[offs[i]:offs[i + 1]], n_slots, slot_size).release()
            for i in (2, 3) if arena_regions else ():
                Arena.init(buf[offs[i]:offs[i + 1]], arena_regions, arena_region_bytes).release_buffers()
            HEADER.pack_into(buf, 0, MAGIC, VERSION, os.getpid(), 0, pid_namespace(), n_slots,
                             slot_size, offs[1] - offs[0], arena_regions, arena_region_bytes)
            return cls(seg, True, spin_us, check_interval)
        except BaseException:
            seg.close()
            raise

    @classmethod
    def attach(cls, name: str, *, spin_us: float = 50.0, check_interval: float = 0.1) -> "ShmTransport":
        """The client end of the channel `name` (never unlinks it)."""
        seg = Segment.attach(name)
        try:
            struct.pack_into("<I", seg.buf, _CLIENT_PID_AT, os.getpid())
            return cls(seg, False, spin_us, check_interval)
        except BaseException:
            seg.close()
            raise

    @property
    def name(self) -> str:
        return self._segment.name

    @property
    def address(self) -> str:
        return f"shm://{self._segment.name}"

    def _check_peer(self) -> None:
        buf = self._segment.buf
        if buf is None or not self._same_ns:
            return
        spid, cpid = struct.unpack_from("<II", buf, 8)
        peer = cpid if self.server else spid
        if peer and not pid_alive(peer):
            raise PeerClosed(f"the {'client' if self.server else 'server'} process {peer} "
                             "died without closing the channel")

    def send(self, record: bytes, timeout: float | None = None) -> None:
        if self._closed:
            raise PeerClosed("this end of the channel is closed")
        self._tx.send(record, timeout)

    def recv(self, timeout: float | None = None) -> bytes:
        if self._closed:
            raise PeerClosed("this end of the channel is closed")
        return self._rx.recv(timeout)

    def close(self) -> None:
        """Mark both directions closed (waking the peer), drop our views, and
        unlink the segment if we created it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        parts = [self._tx, self._rx] + [a for a in (self.tx_arena, self.rx_arena) if a is not None]
        try:
            for p in parts:
                p.mark_closed()
        finally:
            self._tx.release()
            self._rx.release()
            for a in (self.tx_arena, self.rx_arena):
                if a is not None:
                    a.release_buffers()
            self._segment.close()
