"""The shared-memory ring: order, wrap-around, full and empty rings, corruption, wake-ups."""
from __future__ import annotations

import mmap
import platform
import subprocess
import sys
import threading
import time
from collections import deque

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetero_sd.transport import CorruptRecord, PeerClosed, RecordTooLarge, TransportError, TransportTimeout
from hetero_sd.transport.ring import CONS_WAITING, PROD_WAITING, SLOT_HEADER, SLOTS_AT, Ring, ring_bytes
from helpers.waiting import HANG_S, finishes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="futex: Linux only")

SLOT = 64
PAYLOAD = SLOT - SLOT_HEADER.size


def make_ring(n_slots=8, start=0, **kw) -> Ring:
    mm = mmap.mmap(-1, ring_bytes(n_slots, SLOT))  # anonymous shared mapping: enough in one process
    return Ring.init(memoryview(mm), n_slots, SLOT, start=start, **kw)


def payload(i: int, n: int) -> bytes:
    return bytes((i * 31 + j) % 251 for j in range(n))


# A waiter that only a FUTEX_WAKE may end: its timeout and check interval both
# outlast HANG_S, so neither can end the wait before the test gives up on it.
ASLEEP = dict(spin_us=0, check_interval=5 * HANG_S)


def wait_until_asleep(ring: Ring, flag: int) -> None:
    """Until the waiter has stored its WAITING flag (its spin is over and it is
    in the sleep handshake), then a moment more for it to reach FUTEX_WAIT."""
    deadline = time.monotonic() + HANG_S
    while not ring._w.words[flag]:
        assert time.monotonic() < deadline, f"the waiter never went to sleep within {HANG_S} s"
        time.sleep(0.005)
    time.sleep(0.05)


# ------------------------------------------------------------------ the ring against a deque
ops = st.lists(st.one_of(st.just(None), st.integers(0, 5 * PAYLOAD)), min_size=1, max_size=60)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n_slots=st.sampled_from([2, 4, 8]),
       start=st.one_of(st.integers(0, 64), st.integers(2**32 - 40, 2**32 - 1)), schedule=ops)
def test_ring_matches_a_bounded_fifo(n_slots, start, schedule):
    """Random sends (a size) and receives (None) against a model: same records in
    the same order, TransportTimeout exactly when the model is full or empty,
    RecordTooLarge for records over the capacity; positions cross 2**32."""
    ring = make_ring(n_slots, start)
    model: deque[bytes] = deque()
    used = 0  # slots the model's records occupy
    for i, op in enumerate(schedule):
        if op is None:
            if not model:
                with pytest.raises(TransportTimeout):
                    ring.recv(timeout=0)
                continue
            expected = model.popleft()
            used -= max(1, -(-len(expected) // PAYLOAD))
            assert ring.recv(timeout=0) == expected
            continue
        data, need = payload(i, op), max(1, -(-op // PAYLOAD))
        if need > n_slots:
            with pytest.raises(RecordTooLarge):
                ring.send(data, timeout=0)
        elif used + need > n_slots:
            with pytest.raises(TransportTimeout):
                ring.send(data, timeout=0)
        else:
            ring.send(data, timeout=0)
            model.append(data)
            used += need
    while model:
        assert ring.recv(timeout=0) == model.popleft()
    assert ring.pending() == 0


def test_positions_wrap_past_2_to_the_32():
    ring = make_ring(4, start=2**32 - 3)
    for i in range(20):
        ring.send(payload(i, 100), timeout=0)  # 3 slots each: crosses the wrap mid-record
        assert ring.recv(timeout=0) == payload(i, 100)
    assert ring._tail < 100  # wrapped


# ------------------------------------------------------------------ corrupt and stale records
@settings(max_examples=120, deadline=None)
@given(size=st.integers(1, 3 * PAYLOAD), where=st.floats(0, 1, exclude_max=True), xor=st.integers(1, 255))
def test_any_flipped_byte_in_a_record_is_rejected(size, where, xor):
    ring = make_ring(8)
    ring.send(payload(1, size), timeout=0)
    need = -(-size // PAYLOAD)
    # The bytes a record owns: each slot's header plus the payload bytes it uses.
    owned = []
    for k in range(need):
        off = SLOTS_AT + k * SLOT
        used = min(PAYLOAD, size - k * PAYLOAD)
        owned += range(off, off + SLOT_HEADER.size + used)
    target = owned[int(where * len(owned))]
    ring.buf[target] ^= xor
    with pytest.raises(CorruptRecord):
        ring.recv(timeout=0)


def test_a_record_from_an_earlier_lap_is_stale():
    ring = make_ring(4)
    for i in range(4):
        ring.send(payload(i, 10), timeout=0)
        ring.recv(timeout=0)
    # Slot 0 still holds lap 0's record (position 0); pretend lap 1 published it.
    ring._w.words[1 * 64 // 4] = 5  # HEAD = 5: positions 4 (slot 0) are "ready"
    with pytest.raises(CorruptRecord, match="stale"):
        ring.recv(timeout=0)


def test_a_length_beyond_what_was_published_is_rejected():
    ring = make_ring(8)
    ring.send(payload(0, 10), timeout=0)
    pos, seq, _, crc = SLOT_HEADER.unpack_from(ring.buf, SLOTS_AT)
    SLOT_HEADER.pack_into(ring.buf, SLOTS_AT, pos, seq, 4 * PAYLOAD, crc)
    with pytest.raises(CorruptRecord, match="published"):
        ring.recv(timeout=0)


def test_geometry_and_magic_are_checked():
    with pytest.raises(TransportError, match="power of two"):
        make_ring(6)
    mm = mmap.mmap(-1, ring_bytes(4, SLOT))
    with pytest.raises(TransportError, match="not a hetero-sd ring"):
        Ring(memoryview(mm))


# ------------------------------------------------------------------ waiting
def test_recv_timeout_fires_on_an_empty_ring():
    ring = make_ring(4, check_interval=0.02)
    t = time.perf_counter()
    with pytest.raises(TransportTimeout):
        finishes(lambda: ring.recv(timeout=0.15))  # the timeout ends it: no hang
    assert time.perf_counter() - t >= 0.15


def test_send_on_a_full_ring_waits_then_times_out_and_recovers():
    ring = make_ring(2)
    ring.send(b"a", timeout=0)
    ring.send(b"b", timeout=0)
    t = time.perf_counter()
    with pytest.raises(TransportTimeout, match="free slot"):
        finishes(lambda: ring.send(b"c", timeout=0.1))
    assert time.perf_counter() - t >= 0.1
    assert ring.recv(timeout=0) == b"a"
    ring.send(b"c", timeout=0)
    assert [ring.recv(timeout=0) for _ in range(2)] == [b"b", b"c"]


@pytest.mark.parametrize("full", [False, True], ids=["consumer-sleeps", "producer-sleeps"])
def test_a_sleeping_waiter_is_woken_by_the_futex_not_by_its_timeout(full):
    # Timeout and check_interval 300 s, the join 60 s: only a FUTEX_WAKE can end
    # the wait while the test still waits for it.
    ring = make_ring(2, **ASLEEP)
    if full:
        ring.send(b"a", timeout=0)
        ring.send(b"b", timeout=0)
    done = []
    waiter = threading.Thread(daemon=True, target=lambda: done.append(
        ring.send(b"c", timeout=5 * HANG_S) if full else ring.recv(timeout=5 * HANG_S)))
    waiter.start()
    wait_until_asleep(ring, PROD_WAITING if full else CONS_WAITING)
    if full:
        ring.recv(timeout=0)
    else:
        ring.send(b"x", timeout=0)
    waiter.join(HANG_S)
    assert not waiter.is_alive(), "the waiter was not woken"
    assert done == [None] if full else done == [b"x"]


def test_no_wake_up_is_lost_in_a_long_ping_pong():
    """Two threads, spin 0 (every wait goes to the futex path): a lost wake-up
    would stall for check_interval (30 s) and trip the 20 s timeout."""
    ping, pong = make_ring(2, spin_us=0, check_interval=30), make_ring(2, spin_us=0, check_interval=30)
    n = 1500
    errors = []

    def echo():
        try:
            for _ in range(n):
                pong.send(ping.recv(timeout=20), timeout=20)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    t = threading.Thread(target=echo, daemon=True)
    t.start()
    for i in range(n):
        ping.send(i.to_bytes(4, "little"), timeout=20)
        assert pong.recv(timeout=20) == i.to_bytes(4, "little")
    t.join(HANG_S)
    assert not t.is_alive() and not errors


def test_close_drains_then_raises_peer_closed():
    ring = make_ring(4)
    ring.send(b"last words", timeout=0)
    ring.mark_closed()
    assert ring.recv(timeout=1) == b"last words"
    with pytest.raises(PeerClosed):
        ring.recv(timeout=1)
    with pytest.raises(PeerClosed):
        ring.send(b"more", timeout=1)


def test_close_wakes_a_sleeping_receiver():
    ring = make_ring(4, **ASLEEP)
    got = []

    def wait():
        try:
            ring.recv(timeout=5 * HANG_S)
        except PeerClosed as exc:
            got.append(exc)

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    wait_until_asleep(ring, CONS_WAITING)
    ring.mark_closed()
    t.join(HANG_S)
    assert not t.is_alive(), "the close did not wake the receiver"
    assert len(got) == 1


def test_an_idle_hook_runs_while_asleep_and_can_abort_the_wait():
    calls = []

    def on_idle():
        calls.append(1)
        if len(calls) == 3:
            raise PeerClosed("peer gone")

    ring = make_ring(4, check_interval=0.02, on_idle=on_idle)
    with pytest.raises(PeerClosed, match="peer gone"):
        ring.recv(timeout=10)
    assert len(calls) == 3


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                    reason="the no-libatomic fallback exists on x86-64 only")
def test_without_libatomic_x86_falls_back_to_always_waking():
    code = (
        "import mmap, threading\n"
        "from hetero_sd.transport.sync import ordering_mode, without_libatomic\n"
        "without_libatomic()\n"
        "from hetero_sd.transport.ring import Ring, ring_bytes\n"
        "assert ordering_mode() == 'x86-futex-always-wake', ordering_mode()\n"
        "a = Ring.init(memoryview(mmap.mmap(-1, ring_bytes(2, 64))), 2, 64, spin_us=0, check_interval=30)\n"
        "b = Ring.init(memoryview(mmap.mmap(-1, ring_bytes(2, 64))), 2, 64, spin_us=0, check_interval=30)\n"
        "t = threading.Thread(target=lambda: [b.send(a.recv(timeout=20)) for _ in range(300)])\n"
        "t.start()\n"
        "for i in range(300):\n"
        "    a.send(bytes([i % 256])); assert b.recv(timeout=20) == bytes([i % 256])\n"
        "t.join(); print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
