"""A single-producer / single-consumer ring of fixed-size slots in shared memory.

Layout of one ring (every control word on its own 64-byte line, no false sharing):

    line 0  magic, version, n_slots, slot_size
    line 1  HEAD      slots published by the producer   (futex word for the consumer)
    line 2  TAIL      slots consumed by the consumer    (futex word for the producer)
    line 3  CONSUMER_WAITING   set before the consumer sleeps on HEAD
    line 4  PRODUCER_WAITING   set before the producer sleeps on TAIL
    line 5  CLOSED    either end set it on close
    slots   n_slots x slot_size, each a 16-byte header + payload

HEAD and TAIL are free-running uint32 positions; n_slots is a power of two so
`pos & (n_slots - 1)` stays right across the 2**32 wrap. A record takes
ceil(len / payload) consecutive slots; each slot header is
(pos, seq, length, crc32) where seq is the position of the record's first slot
(the record's sequence number) and crc32 covers the whole payload. A reader
rejects a slot whose pos is not the one it expects (stale: from an earlier lap)
or whose seq/length/crc do not match (torn or corrupt) with CorruptRecord.

Ordering: the producer writes payload and headers, then stores HEAD with a
seq-cst store (release suffices for the payload; seq-cst is for the sleep
handshake below), then loads CONSUMER_WAITING and wakes the futex if set. The
consumer loads HEAD (acquire) before reading slots and publishes TAIL the same
way. A waiter spins ~spin_us, then stores its WAITING flag (seq-cst), re-checks
the word, and FUTEX_WAITs on the word's old value (the kernel re-checks it).
Either the publisher sees the flag and wakes, or the waiter sees the new value.

Waits sleep in slices of at most `check_interval` so that a peer that died
without closing (kill -9) is noticed through the `on_idle` hook and a close
whose wake-up raced the sleep is seen; data wake-ups are immediate.
"""
from __future__ import annotations

import struct
import zlib
from typing import Callable

from hetero_sd.transport.errors import CorruptRecord, PeerClosed, RecordTooLarge, TransportError
from hetero_sd.transport.sync import SharedWords

MAGIC, VERSION = 0x52445348, 1  # "HSDR"
LINE = 64
HEAD, TAIL, CONS_WAITING, PROD_WAITING, CLOSED = (k * LINE // 4 for k in range(1, 6))
SLOTS_AT = 6 * LINE
SLOT_HEADER = struct.Struct("<IIII")  # pos, seq, length, crc32
_CTRL = struct.Struct("<IIII")
MASK = 0xFFFFFFFF


def ring_bytes(n_slots: int, slot_size: int) -> int:
    """Bytes one ring of this geometry occupies."""
    return SLOTS_AT + n_slots * slot_size


def _check_geometry(n_slots: int, slot_size: int) -> None:
    if n_slots < 2 or n_slots & (n_slots - 1) or n_slots > 2**20:
        raise TransportError(f"n_slots={n_slots}: must be a power of two in 2..2**20")
    if slot_size < 64 or slot_size % 64:
        raise TransportError(f"slot_size={slot_size}: must be a multiple of 64, at least 64")


class Ring:
    """One direction of a channel over `buf` (a writable memoryview of
    ring_bytes(...) bytes inside a shared segment). Exactly one process may
    call `send` and one `recv`; the same object may do both (tests)."""

    def __init__(self, buf: memoryview, *, spin_us: float = 50.0, check_interval: float = 0.1,
                 on_idle: Callable[[], None] | None = None):
        magic, version, n_slots, slot_size = _CTRL.unpack_from(buf, 0)
        if magic != MAGIC or version != VERSION:
            raise TransportError(f"not a hetero-sd ring (magic {magic:#x} version {version}; "
                                 f"expected {MAGIC:#x} version {VERSION})")
        _check_geometry(n_slots, slot_size)
        if len(buf) < ring_bytes(n_slots, slot_size):
            raise TransportError(f"ring buffer of {len(buf)} bytes is smaller than its geometry")
        self.buf, self.n_slots, self.slot_size = buf, n_slots, slot_size
        self.payload = slot_size - SLOT_HEADER.size
        self.max_record = n_slots * self.payload
        self._w = SharedWords(buf[:SLOTS_AT])
        self.spin_s, self.check_interval = spin_us * 1e-6, check_interval
        self.on_idle = on_idle
        self._mask = n_slots - 1
        # Hot-path shortcuts (bound once): plain word access, acquire load, publish.
        self._words, self._load, self._publish = self._w.words, self._w.load_acquire, self._w.publish
        self._head = self._load(HEAD)   # producer's own count (only it writes HEAD)
        self._tail = self._load(TAIL)   # consumer's own count (only it writes TAIL)
        self._seen_tail = self._tail    # producer's last look at TAIL
        self._seen_head = self._head    # consumer's last look at HEAD

    @classmethod
    def init(cls, buf: memoryview, n_slots: int, slot_size: int, start: int = 0, **kw) -> "Ring":
        """Format `buf` as an empty ring whose positions start at `start`
        (tests start near 2**32 to cross the wrap), then open it."""
        _check_geometry(n_slots, slot_size)
        buf[:SLOTS_AT] = bytes(SLOTS_AT)
        words = buf[:SLOTS_AT].cast("I")
        words[HEAD] = words[TAIL] = start & MASK
        words.release()
        _CTRL.pack_into(buf, 0, MAGIC, VERSION, n_slots, slot_size)
        return cls(buf, **kw)

    # ------------------------------------------------------------------ producer
    def send(self, data, timeout: float | None = None) -> None:
        n, payload = len(data), self.payload
        need = (n + payload - 1) // payload or 1
        head, words = self._head, self._words
        if need > self.n_slots:
            raise RecordTooLarge(f"record of {n} bytes exceeds this ring's {self.max_record} "
                                 f"bytes ({self.n_slots} slots x {payload}); create the "
                                 "channel with more or larger slots")
        if words[CLOSED]:
            raise PeerClosed("the channel was closed")
        room = self.n_slots - need
        if (head - self._seen_tail) & MASK > room:
            tail = self._load(TAIL)
            if (head - tail) & MASK > room:
                tail = self._wait(TAIL, PROD_WAITING, timeout, lambda t: (head - t) & MASK <= room)
            self._seen_tail = tail
        buf, crc = self.buf, zlib.crc32(data)
        if need == 1:  # the common case, without slicing copies
            off = SLOTS_AT + (head & self._mask) * self.slot_size
            buf[off + 16:off + 16 + n] = data
            SLOT_HEADER.pack_into(buf, off, head, head, n, crc)
        else:
            for i in range(need):
                pos = (head + i) & MASK
                off = SLOTS_AT + (pos & self._mask) * self.slot_size
                chunk = data[i * payload:(i + 1) * payload]
                buf[off + 16:off + 16 + len(chunk)] = chunk
                SLOT_HEADER.pack_into(buf, off, pos, head, n, crc)
        self._head = head = (head + need) & MASK
        self._publish(HEAD, head, CONS_WAITING)

    # ------------------------------------------------------------------ consumer
    def recv(self, timeout: float | None = None) -> bytes:
        tail = self._tail
        if self._seen_head == tail:
            head = self._load(HEAD)
            if head == tail:
                head = self._wait(HEAD, CONS_WAITING, timeout, lambda h: h != tail, empty=True)
            self._seen_head = head
        buf, off = self.buf, SLOTS_AT + (tail & self._mask) * self.slot_size
        pos, seq, n, crc = SLOT_HEADER.unpack_from(buf, off)
        if pos != tail or seq != tail:
            raise CorruptRecord(f"slot {tail & self._mask} holds position {pos} / record {seq}, "
                                f"expected {tail}: stale or overwritten record")
        need = (n + self.payload - 1) // self.payload or 1
        if need == 1:
            data = bytes(buf[off + 16:off + 16 + n])
        else:
            if need > (self._seen_head - tail) & MASK:
                self._seen_head = self._load(HEAD)
                if need > (self._seen_head - tail) & MASK:
                    raise CorruptRecord(f"record {seq} claims {n} bytes ({need} slots) but only "
                                        f"{(self._seen_head - tail) & MASK} slots were published")
            data = b"".join(self._fragment(tail, i, n, crc) for i in range(need))
        if zlib.crc32(data) != crc:
            raise CorruptRecord(f"record {seq} ({n} bytes) fails its checksum: torn or corrupt")
        self._tail = tail = (tail + need) & MASK
        self._publish(TAIL, tail, PROD_WAITING)
        return data

    def _fragment(self, first: int, i: int, n: int, crc: int) -> bytes:
        pos = (first + i) & MASK
        off = SLOTS_AT + (pos & self._mask) * self.slot_size
        hdr = SLOT_HEADER.unpack_from(self.buf, off)
        if hdr != (pos, first, n, crc):
            raise CorruptRecord(f"fragment {i} of record {first} has header {hdr}, "
                                f"expected {(pos, first, n, crc)}")
        start = i * self.payload
        return bytes(self.buf[off + 16:off + 16 + min(self.payload, n - start)])

    def pending(self) -> int:
        """Slots published and not yet consumed (a snapshot)."""
        return (self._w.load_acquire(HEAD) - self._w.load_acquire(TAIL)) & MASK

    def _wait(self, word: int, flag: int, timeout: float | None, ready, empty: bool = False) -> int:
        return self._w.wait(word, flag, CLOSED, ready, timeout, spin_s=self.spin_s,
                            check_interval=self.check_interval, on_idle=self.on_idle,
                            what="record" if empty else "free slot")

    # ------------------------------------------------------------------ closing
    def mark_closed(self) -> None:
        """Tell both ends this ring is finished and wake whoever sleeps on it."""
        w = self._w
        w.store_seqcst(CLOSED, 1)
        w.futex_wake(HEAD)
        w.futex_wake(TAIL)

    @property
    def closed(self) -> bool:
        return bool(self._w.load_acquire(CLOSED))

    def release(self) -> None:
        """Drop this object's exports of the shared buffer (before unmapping)."""
        self._words = self._load = self._publish = None
        self._w.release()
        self.buf = None
