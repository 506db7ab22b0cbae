"""Every transport passes the same round-trip, timeout and close tests, in one
process and across a spawned process; shm also with a tiny ring that wraps."""
from __future__ import annotations

import multiprocessing
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from hetero_sd.ir.work import DraftRequest, DraftResult, VerifyRequest
from hetero_sd.transport import (
    KINDS,
    PeerClosed,
    RecordTooLarge,
    TransportError,
    TransportTimeout,
    connect,
    listen,
)
from hetero_sd.transport.serve import serve
from helpers.waiting import finishes

sys.path.insert(0, str(Path(__file__).parent))
import transport_peers  # noqa: E402

CTX = multiprocessing.get_context("spawn")
CROSS = [k for k in KINDS if k != "inproc"]
SHM_OK = os.path.isdir("/dev/shm") and sys.platform.startswith("linux")


def kinds(names):
    return [pytest.param(k, marks=pytest.mark.skipif(k == "shm" and not SHM_OK, reason="Linux shm"))
            for k in names]


def records():
    yield DraftRequest(3, 17, 5, list(range(40))).pack()
    yield VerifyRequest(3, 17, [9, 8, 7, 6, 5, 4]).pack()
    yield DraftResult(3, []).pack()
    yield b""
    yield bytes(range(256)) * 400  # 100 KiB: many slots on shm


@pytest.fixture
def pair(request):
    server = listen(request.param)
    client = connect(server.address)  # same process: no handed_over(), the client is our object
    yield server, client
    client.close()
    server.close()


@pytest.mark.parametrize("pair", kinds(KINDS), indirect=True)
def test_records_cross_both_ways_in_order(pair):
    server, client = pair
    for rec in records():
        server.send(rec, timeout=5)
    assert [client.recv(timeout=5) for _ in records()] == list(records())
    for rec in records():
        client.send(rec, timeout=5)
        assert server.recv(timeout=5) == rec
    assert DraftRequest.unpack(list(records())[0]) == DraftRequest(3, 17, 5, list(range(40)))


@pytest.mark.parametrize("pair", kinds(KINDS), indirect=True)
def test_recv_timeout_fires(pair):
    server, client = pair
    t = time.perf_counter()
    with pytest.raises(TransportTimeout):
        finishes(lambda: client.recv(timeout=0.1))  # the timeout ends it: no hang
    assert time.perf_counter() - t >= 0.09


@pytest.mark.parametrize("pair", kinds(KINDS), indirect=True)
def test_closing_one_end_raises_peer_closed_on_the_other(pair):
    server, client = pair
    server.send(b"bye", timeout=5)
    server.close()
    assert client.recv(timeout=5) == b"bye"  # what was sent before the close still arrives
    with pytest.raises(PeerClosed):
        client.recv(timeout=5)


@pytest.mark.parametrize("kind", kinds(CROSS))
def test_a_spawned_echo_worker_returns_every_record(kind):
    with listen(kind) as server:
        p = CTX.Process(target=serve, args=(server.address,), kwargs={"idle_timeout": 60})
        p.start()
        server.handed_over()
        try:
            for i in range(300):
                rec = VerifyRequest(i, i * 3, list(range(i % 17))).pack() + bytes(i % 300)
                server.send(rec, timeout=30)
                assert server.recv(timeout=30) == rec
        finally:
            server.close()
            p.join(30)
    assert p.exitcode == 0


@pytest.mark.skipif(not SHM_OK, reason="Linux shm")
def test_shm_stream_from_another_process_through_a_tiny_wrapping_ring():
    """3000 records of 0..699 bytes through 16 slots of 64 bytes: the producer
    blocks on a full ring over and over, positions lap the ring ~1000 times."""
    count = 3000
    with listen("shm", n_slots=16, slot_size=64) as server:
        p = CTX.Process(target=transport_peers.numbered_stream, args=(server.address, count))
        p.start()
        try:
            for i in range(count):
                assert server.recv(timeout=30) == transport_peers.record_for(i), f"record {i}"
            server.send(b"done", timeout=5)
        finally:
            p.join(30)
    assert p.exitcode == 0


@pytest.mark.parametrize("kind", kinds(CROSS))
def test_a_peer_killed_mid_conversation_is_detected(kind):
    options = {"check_interval": 0.05} if kind == "shm" else {}
    with listen(kind, **options) as server:
        p = CTX.Process(target=transport_peers.kill_self_after, args=(server.address, 3))
        p.start()
        server.handed_over()
        for i in range(3):
            server.send(bytes([i]), timeout=30)
            assert server.recv(timeout=30) == bytes([i])
        # The death ends the wait (PeerClosed; on shm the pid check says "died"),
        # not the 30 s timeout, whose expiry would raise TransportTimeout instead.
        with pytest.raises(PeerClosed, match="died" if kind == "shm" else None):
            server.recv(timeout=30)
        p.join(30)


@pytest.mark.skipif(not SHM_OK, reason="Linux shm")
def test_shm_refuses_a_record_larger_than_the_ring():
    with listen("shm", n_slots=4, slot_size=64) as server:
        with pytest.raises(RecordTooLarge, match="more or larger slots"):
            server.send(bytes(4 * 48 + 1))
        server.send(bytes(4 * 48), timeout=0)  # exactly the capacity fits


def test_unknown_kinds_and_addresses_are_refused():
    with pytest.raises(TransportError, match="choose one of"):
        listen("carrier-pigeon")
    with pytest.raises(TransportError, match="not a transport address"):
        connect("udp://127.0.0.1:9")
    with pytest.raises(TransportError, match="no in-process channel"):
        connect("inproc://999999")


def test_tcp_refuses_a_client_without_the_token():
    with listen("tcp") as server:
        host_port, token = server.address.rsplit("/", 1)
        intruder = connect(f"{host_port}/{'00' * 16}")
        with pytest.raises(TransportError, match="token"):
            server.recv(timeout=5)
        intruder.close()
