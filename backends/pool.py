"""Bookkeeping of a KV pool: which positions belong to which sequence.

Runtime-neutral (no tensors): each backend pre-allocates its own buffers of
`capacity` positions and asks this allocator where a sequence lives. A
sequence is a contiguous extent [offset, offset+reserved) with a fill length;
truncating changes the length only, so rollback never moves KV data.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from hetero_sd.backends.base import PoolUsage, Runner
from hetero_sd.ir.errors import KVBudgetError


@dataclass
class Extent:
    offset: int
    reserved: int
    length: int = 0


class PooledRunner(Runner):
    """The runner methods that only consult the pool's bookkeeping (`self._alloc`),
    shared by every backend's runner."""

    _alloc: "ExtentAllocator"

    def truncate(self, seq_id: int, length: int) -> None:
        self._alloc.truncate(seq_id, length)

    def length(self, seq_id: int) -> int:
        return self._alloc.extent(seq_id).length

    def release(self, seq_id: int) -> None:
        self._alloc.release(seq_id)

    def usage(self) -> PoolUsage:
        return self._alloc.usage()


class ExtentAllocator:
    def __init__(self, capacity: int, bytes_per_token: int, owner: str):
        self.capacity = capacity
        self.bytes_per_token = bytes_per_token
        self.owner = owner  # named in errors, e.g. "torch:cpu fp32 target pool"
        self._seqs: dict[int, Extent] = {}
        self._next_id = 0

    def allocate(self, reserved: int) -> int:
        offset = self._first_fit(reserved)
        if offset is None:
            free = self.capacity - sum(e.reserved for e in self._seqs.values())
            raise KVBudgetError(
                f"{self.owner}: KV budget exhausted: a sequence needs {reserved} positions "
                f"({reserved * self.bytes_per_token / 2**20:.1f} MiB) but only {free} of "
                f"{self.capacity} are free; raise memory.kv_budget or shorten the request")
        self._next_id += 1
        self._seqs[self._next_id] = Extent(offset, reserved)
        return self._next_id

    def _first_fit(self, size: int) -> int | None:
        cursor = 0
        for ext in sorted(self._seqs.values(), key=lambda e: e.offset):
            if ext.offset - cursor >= size:
                return cursor
            cursor = ext.offset + ext.reserved
        return cursor if self.capacity - cursor >= size else None

    def extent(self, seq_id: int) -> Extent:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KVBudgetError(f"{self.owner}: no live sequence {seq_id}") from None

    @contextmanager
    def writing(self, seq_id: int, start: int, count: int) -> Iterator[Extent]:
        """Validate writing positions [start, start+count); the new length is
        recorded only if the body (the runtime call) succeeds, so a failed
        call never leaves the sequence claiming positions it did not fill."""
        ext = self.extent(seq_id)
        if start > ext.length:
            raise ValueError(f"sequence {seq_id}: write at {start} leaves a gap after length {ext.length}")
        if start + count > ext.reserved:
            raise KVBudgetError(
                f"{self.owner}: sequence {seq_id} reserved {ext.reserved} positions, "
                f"a write would reach {start + count}")
        yield ext
        ext.length = start + count

    def truncate(self, seq_id: int, length: int) -> None:
        ext = self.extent(seq_id)
        if not 0 <= length <= ext.length:
            raise ValueError(f"sequence {seq_id}: cannot truncate length {ext.length} to {length}")
        ext.length = length

    def release(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)

    def usage(self) -> PoolUsage:
        # One snapshot (taken without running Python code between items): a server's
        # metrics thread may ask while the engine thread allocates.
        extents = list(self._seqs.values())
        return PoolUsage(
            capacity_tokens=self.capacity,
            used_tokens=sum(e.reserved for e in extents),
            filled_tokens=sum(e.length for e in extents),
            bytes_total=self.capacity * self.bytes_per_token,
            sequences=len(extents),
        )
