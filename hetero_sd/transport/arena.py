"""A shared arena for large tensors: written in place, read as a zero-copy view.

A draft's probability rows (k x vocab float32: 5 x 152,064 = 3 MB) or hidden
states never go through the ring: the producer writes them straight into the
arena (a numpy view over the shared mapping), the record carries a TensorRef
(region, generation, offset, dtype, shape), and the consumer gets a numpy view
of the same bytes.

Allocation and overlap protection: the arena is `n_regions` regions, each a
bump allocator. The writer `claim()`s the next region (round robin), which
waits until the reader has `release()`d it, bumps its generation and resets
its offset; `Lease.alloc` hands out 64-byte-aligned views inside it. So a
region is never rewritten while the reader may still look at it, and a
TensorRef from an earlier claim of the region (a stale generation) or a freed
region is rejected with CorruptRecord. With 2 regions the writer can fill the
next round's rows while the reader still holds the last ones (double
buffering); asynchronous drafting that runs further ahead needs more regions.
Views the reader keeps after `release()` may be overwritten: copy first.

Visibility: the tensor bytes are written before the record carrying the ref is
sent, and the ring's release/acquire on its HEAD word orders them, so the
arena needs no barrier of its own. Only the region state words (FREE/HELD,
one writer each way) use the sync primitives, for the writer's wait.

Layout: line 0 magic/version/n_regions/region_bytes, line 1 WRITER_WAITING,
line 2 CLOSED, then one line per region (STATE, GEN), data from the next
4096-byte boundary, regions 4096-aligned.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from hetero_sd.transport.errors import CorruptRecord, TransportError
from hetero_sd.transport.sync import SharedWords

MAGIC, VERSION = 0x41445348, 1  # "HSDA"
LINE, PAGE = 64, 4096
WRITER_WAITING, CLOSED = 16, 32  # word indices (lines 1 and 2)
_CTRL = struct.Struct("<IIIQ")
FREE, HELD = 0, 1
MAX_DIMS = 4
DTYPES = {1: np.float32, 2: np.float16, 3: np.float64, 4: np.int32, 5: np.int64,
          6: np.uint8, 7: np.uint16, 8: np.int8}  # bfloat16 travels as uint16 bits
_CODES = {np.dtype(t): c for c, t in DTYPES.items()}


def _state_word(region: int) -> int:
    return (3 + region) * LINE // 4


def _data_at(n_regions: int) -> int:
    return -(-(3 + n_regions) * LINE // PAGE) * PAGE


def arena_bytes(n_regions: int, region_bytes: int) -> int:
    """Bytes an arena of this geometry occupies (0 regions: no arena)."""
    if n_regions == 0:
        return 0
    return _data_at(n_regions) + n_regions * -(-region_bytes // PAGE) * PAGE


@dataclass(frozen=True)
class TensorRef:
    """Where a tensor sits in an arena: packs to 32 bytes."""

    region: int
    gen: int
    offset: int  # bytes from the region's start
    dtype: np.dtype
    shape: tuple[int, ...]

    _S = struct.Struct(f"<HBBIQ{MAX_DIMS}I")

    def pack(self) -> bytes:
        dims = tuple(self.shape) + (0,) * (MAX_DIMS - len(self.shape))
        return self._S.pack(self.region, _CODES[np.dtype(self.dtype)], len(self.shape),
                            self.gen, self.offset, *dims)

    @classmethod
    def unpack_from(cls, buf, offset: int = 0) -> "TensorRef":
        region, code, ndim, gen, off, *dims = cls._S.unpack_from(buf, offset)
        if code not in DTYPES or ndim > MAX_DIMS:
            raise CorruptRecord(f"tensor ref with dtype code {code} / {ndim} dims "
                                f"(known codes {sorted(DTYPES)}, at most {MAX_DIMS} dims)")
        return cls(region, gen, off, np.dtype(DTYPES[code]), tuple(dims[:ndim]))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


REF_SIZE = TensorRef._S.size
_COUNT = struct.Struct("<I")


def pack_frame(record: bytes, refs: Sequence[TensorRef] = ()) -> bytes:
    """A work-IR record with the tensor refs that go with it, as one message."""
    return _COUNT.pack(len(refs)) + b"".join(r.pack() for r in refs) + record


def unpack_frame(frame: bytes) -> tuple[bytes, list[TensorRef]]:
    (n,) = _COUNT.unpack_from(frame, 0)
    if len(frame) < 4 + n * REF_SIZE:
        raise CorruptRecord(f"frame of {len(frame)} bytes cannot hold its {n} tensor refs")
    refs = [TensorRef.unpack_from(frame, 4 + i * REF_SIZE) for i in range(n)]
    return frame[4 + n * REF_SIZE:], refs


class Lease:
    """The writer's hold on one region until the reader releases it."""

    def __init__(self, arena: "Arena", region: int, gen: int):
        self.arena, self.region, self.gen, self.used = arena, region, gen, 0

    def alloc(self, shape, dtype=np.float32) -> tuple[TensorRef, np.ndarray]:
        """A writable view of `shape` in this region and the ref to send for it."""
        shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(d) for d in shape)
        dtype = np.dtype(dtype)
        if dtype not in _CODES or len(shape) > MAX_DIMS:
            raise TransportError(f"arena tensors are {sorted(str(np.dtype(t)) for t in DTYPES.values())} "
                                 f"with at most {MAX_DIMS} dims; got {dtype} {shape}")
        offset = -(-self.used // LINE) * LINE
        ref = TensorRef(self.region, self.gen, offset, dtype, shape)
        nbytes = ref.nbytes
        if offset + nbytes > self.arena.region_bytes:
            raise TransportError(f"arena region of {self.arena.region_bytes} bytes cannot hold "
                                 f"{dtype} {shape} after {offset} bytes already used; create the "
                                 "channel with a larger arena_region_bytes")
        self.used = offset + nbytes
        return ref, self.arena._array(ref, writable=True)


class Arena:
    """Regions of a shared buffer; one process writes (claim/alloc), the other
    reads (view/release)."""

    def __init__(self, buf: memoryview, *, spin_us: float = 50.0, check_interval: float = 0.1,
                 on_idle=None):
        magic, version, n_regions, region_bytes = _CTRL.unpack_from(buf, 0)
        if magic != MAGIC or version != VERSION:
            raise TransportError(f"not a hetero-sd arena (magic {magic:#x} version {version})")
        self.n_regions, self.region_bytes = n_regions, region_bytes
        self.stride = -(-region_bytes // PAGE) * PAGE
        self._w = SharedWords(buf[:_data_at(n_regions)])
        self._data = np.frombuffer(buf[_data_at(n_regions):], dtype=np.uint8)
        self.spin_s, self.check_interval, self.on_idle = spin_us * 1e-6, check_interval, on_idle
        self._next = 0

    @classmethod
    def init(cls, buf: memoryview, n_regions: int, region_bytes: int, **kw) -> "Arena":
        if not 1 <= n_regions <= 64 or region_bytes < 1:
            raise TransportError(f"arena of {n_regions} regions x {region_bytes} bytes: "
                                 "need 1..64 regions of at least 1 byte")
        buf[:_data_at(n_regions)] = bytes(_data_at(n_regions))
        _CTRL.pack_into(buf, 0, MAGIC, VERSION, n_regions, region_bytes)
        return cls(buf, **kw)

    @property
    def base_address(self) -> int:
        """Address of the data area in this process (for zero-copy checks)."""
        return self._data.__array_interface__["data"][0]

    # ------------------------------------------------------------------ writer
    def claim(self, timeout: float | None = None) -> Lease:
        """The next region, once the reader has released it."""
        i, w = self._next, self._w
        word = _state_word(i)
        w.wait(word, WRITER_WAITING, CLOSED, lambda s: s == FREE, timeout, spin_s=self.spin_s,
               check_interval=self.check_interval, on_idle=self.on_idle, what=f"free arena region {i}")
        gen = (w.words[word + 1] + 1) & 0xFFFFFFFF
        w.words[word + 1] = gen
        w.store_release(word, HELD)
        self._next = (i + 1) % self.n_regions
        return Lease(self, i, gen)

    # ------------------------------------------------------------------ reader
    def view(self, ref: TensorRef) -> np.ndarray:
        """A read-only zero-copy view of the tensor `ref` points to."""
        self.check(ref)
        if ref.offset + ref.nbytes > self.region_bytes or ref.offset < 0:
            raise CorruptRecord(f"tensor ref {ref.shape} {ref.dtype} at {ref.offset} overruns "
                                f"its {self.region_bytes}-byte region")
        return self._array(ref, writable=False)

    def check(self, ref: TensorRef) -> None:
        """Raise CorruptRecord unless `ref`'s region is held at its generation (a
        device data plane keeps its region states here and its bytes elsewhere)."""
        if not 0 <= ref.region < self.n_regions:
            raise CorruptRecord(f"tensor ref names region {ref.region}; the arena has {self.n_regions}")
        word = _state_word(ref.region)
        state, gen = self._w.load_acquire(word), self._w.words[word + 1]
        if state != HELD or gen != ref.gen:
            raise CorruptRecord(f"stale tensor ref: region {ref.region} generation {ref.gen}, "
                                f"the region is {'held' if state == HELD else 'free'} at generation {gen}")

    def release(self, region: int) -> None:
        """The reader is done with `region`: the writer may reuse it."""
        self._w.publish(_state_word(region), FREE, WRITER_WAITING)

    # ------------------------------------------------------------------ both
    def _array(self, ref: TensorRef, writable: bool) -> np.ndarray:
        arr = np.ndarray(ref.shape, ref.dtype, self._data, ref.region * self.stride + ref.offset)
        if not writable:
            arr.flags.writeable = False
        return arr

    def mark_closed(self) -> None:
        w = self._w
        w.store_seqcst(CLOSED, 1)
        for i in range(self.n_regions):
            w.futex_wake(_state_word(i))

    def release_buffers(self) -> None:
        self._w.release()
        self._data = None
