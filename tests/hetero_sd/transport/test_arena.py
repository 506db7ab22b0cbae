"""The tensor arena: zero-copy views, round trips across processes, stale refs rejected."""
from __future__ import annotations

import mmap
import multiprocessing
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetero_sd.transport import (
    CorruptRecord,
    TensorRef,
    TransportError,
    TransportTimeout,
    listen,
    pack_frame,
    unpack_frame,
)
from hetero_sd.transport.arena import DTYPES, Arena, arena_bytes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="futex: Linux only")
sys.path.insert(0, str(Path(__file__).parent))
import transport_peers  # noqa: E402

CTX = multiprocessing.get_context("spawn")


def make_arena(n_regions=2, region_bytes=1 << 16, **kw) -> Arena:
    mm = mmap.mmap(-1, arena_bytes(n_regions, region_bytes))
    return Arena.init(memoryview(mm), n_regions, region_bytes, **kw)


def data_address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_the_reader_view_is_the_writers_memory():
    arena = make_arena()
    lease = arena.claim(timeout=0)
    ref, w = lease.alloc((5, 1000), np.float32)
    w[:] = 1.5
    r = arena.view(ref)
    assert np.shares_memory(r, w) and data_address(r) == data_address(w)
    assert data_address(r) == arena.base_address + ref.region * arena.stride + ref.offset
    w[2, 7] = -3.0  # written after the ref was taken: visible, so nothing was copied
    assert r[2, 7] == -3.0 and r.sum() == pytest.approx(1.5 * 4999 - 3.0)
    assert not r.flags.writeable and w.flags.writeable


def test_allocations_in_a_region_do_not_overlap_and_are_aligned():
    arena = make_arena()
    lease = arena.claim(timeout=0)
    sizes = [(3, np.int8), (10, np.float32), (7, np.int64), (1, np.uint16)]
    views = [lease.alloc((n,), dt)[1] for n, dt in sizes]
    for i, a in enumerate(views):
        assert data_address(a) % 64 == 0
        for b in views[i + 1:]:
            assert not np.shares_memory(a, b)


def test_a_region_overflow_names_the_option_to_raise():
    arena = make_arena(region_bytes=4096)
    lease = arena.claim(timeout=0)
    lease.alloc((512,), np.float32)
    lease.alloc((512,), np.float32)  # exactly full
    with pytest.raises(TransportError, match="arena_region_bytes"):
        lease.alloc((1,), np.uint8)


def test_regions_are_reused_only_after_release_and_old_refs_go_stale():
    arena = make_arena(n_regions=2)
    a, b = arena.claim(timeout=0), arena.claim(timeout=0)
    ref_a, _ = a.alloc((4,))
    with pytest.raises(TransportTimeout, match="free arena region 0"):
        arena.claim(timeout=0.05)  # both regions held by the reader
    arena.release(ref_a.region)
    again = arena.claim(timeout=0)
    assert again.region == a.region and again.gen == a.gen + 1
    with pytest.raises(CorruptRecord, match="stale"):
        arena.view(ref_a)  # the earlier generation
    ref_b, _ = b.alloc((4,))
    arena.release(ref_b.region)
    with pytest.raises(CorruptRecord, match="free"):
        arena.view(ref_b)  # released, not claimed again


def test_refs_that_point_outside_the_arena_are_rejected():
    arena = make_arena(region_bytes=4096)
    lease = arena.claim(timeout=0)
    ref, _ = lease.alloc((4,))
    with pytest.raises(CorruptRecord, match="region 5"):
        arena.view(TensorRef(5, ref.gen, 0, np.dtype(np.float32), (4,)))
    with pytest.raises(CorruptRecord, match="overruns"):
        arena.view(TensorRef(ref.region, ref.gen, 4000, np.dtype(np.float32), (100,)))


refs = st.builds(
    TensorRef, region=st.integers(0, 63), gen=st.integers(0, 2**32 - 1), offset=st.integers(0, 2**40),
    dtype=st.sampled_from([np.dtype(t) for t in DTYPES.values()]),
    shape=st.lists(st.integers(0, 2**31), min_size=1, max_size=4).map(tuple))


@settings(max_examples=100, deadline=None)
@given(record=st.binary(max_size=300), tensor_refs=st.lists(refs, max_size=4))
def test_frames_round_trip_a_record_and_its_refs(record, tensor_refs):
    assert unpack_frame(pack_frame(record, tensor_refs)) == (record, tensor_refs)


def test_a_frame_with_an_unknown_dtype_code_is_rejected():
    frame = bytearray(pack_frame(b"r", [TensorRef(0, 1, 0, np.dtype(np.float32), (2,))]))
    frame[4 + 2] = 99  # the dtype code byte
    with pytest.raises(CorruptRecord, match="dtype code 99"):
        unpack_frame(bytes(frame))


def test_probability_rows_cross_processes_without_a_copy():
    """A worker writes k x vocab rows in place three times over two regions;
    the server reads each through a view at its own arena's address."""
    rows, vocab, rounds = 5, 152_064, 3
    with listen("shm", arena_regions=2, arena_region_bytes=rows * vocab * 4) as server:
        p = CTX.Process(target=transport_peers.arena_producer, args=(server.address, rows, vocab, rounds))
        p.start()
        try:
            arena = server.rx_arena
            for r in range(rounds):
                server.send(b"draft", timeout=30)
                record, (ref,) = unpack_frame(server.recv(timeout=60))
                probs = arena.view(ref)
                assert record == b"probs" and probs.shape == (rows, vocab) and probs.dtype == np.float32
                assert data_address(probs) == arena.base_address + ref.region * arena.stride + ref.offset
                np.testing.assert_array_equal(probs[:, 0], np.arange(rows) + r)
                np.testing.assert_array_equal(probs[:, -1], np.arange(rows) + r)
                arena.release(ref.region)
            server.send(b"done", timeout=5)
        finally:
            p.join(60)
    assert p.exitcode == 0
