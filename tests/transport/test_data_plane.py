"""Data planes (hetero_sd/transport/planes.py): the CUDA IPC plane's shared code,
run here over SharedCpuBuffers (shared-memory CPU tensors standing in for device
buffers), and over CudaBuffers where a GPU is at hand. Checks: handles opened
once per buffer and reused, stale and unannounced refs refused, a dead owner's
buffer a clear IpcOwnerGone, the wire's announcements, and the plane choice."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from hetero_sd.drafting.wire import DRAFT, OK, Reply, decode_reply, encode_reply
from hetero_sd.ir.errors import ConfigError
from hetero_sd.transport import CorruptRecord, TransportError, connect, listen
from hetero_sd.transport.ipc_buffers import BUFFER_KINDS
from hetero_sd.transport.planes import (DeviceReader, DeviceWriter, IpcOwnerGone, channel_options, choose_plane,
                                        reader_for, resolve, writer_for)


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


KINDS = ["cpu_ipc", pytest.param("cuda_ipc", marks=pytest.mark.skipif(not _cuda(), reason="needs CUDA"))]
VOCAB, ROWS = 1000, 4


@pytest.fixture
def pair():
    """A shm channel whose arenas hold control words only, as a device plane's do."""
    server = listen("shm", **channel_options("cpu_ipc", VOCAB, ROWS))
    client = connect(server.address)
    yield server, client
    client.close()
    server.close()


def _planes(pair, kind, alive=None):
    server, client = pair
    device = "cuda" if kind == "cuda_ipc" else "cpu"
    writer = DeviceWriter(client.tx_arena, BUFFER_KINDS[kind](device), ROWS * VOCAB * 8)
    reader = DeviceReader(server.rx_arena, BUFFER_KINDS[kind](), **({"alive": alive} if alive else {}))
    return writer, reader


def _send(writer, rows):
    ref, view = writer.claim(timeout=5).alloc(rows.shape, np.float64)
    writer.write(view, rows)
    writer.flush()
    return ref, writer.announcements()


@pytest.mark.parametrize("kind", KINDS)
def test_handles_are_opened_once_per_buffer_and_reused(pair, kind):
    writer, reader = _planes(pair, kind)
    rng = np.random.default_rng(0)
    sizes = []
    for i in range(12):
        rows = rng.random((ROWS - i % 2, VOCAB))
        ref, announce = _send(writer, rows)
        sizes.append(len(announce))
        reader.accept(announce)
        np.testing.assert_array_equal(reader.read(ref), rows)
        reader.release(ref.region)
    assert reader.opens == 2 == writer.control.n_regions  # one open per buffer, then the cache
    assert sizes[0] > 0 and sizes[1] > 0 and sizes[2:] == [0] * 10  # each handle travels once
    writer.close()
    reader.close()


def test_stale_unannounced_and_overrunning_refs_are_refused(pair):
    writer, reader = _planes(pair, "cpu_ipc")
    rows = np.ones((2, VOCAB))
    ref, announce = _send(writer, rows)
    with pytest.raises(CorruptRecord, match="never announced"):
        reader.read(ref)  # the record that carried its handle was not read
    reader.accept(announce)
    reader.read(ref)
    reader.release(ref.region)
    with pytest.raises(CorruptRecord, match="stale"):
        reader.read(ref)  # released: the writer may be rewriting it
    for _ in range(2):  # the same region claimed again: a new generation
        again, announce = _send(writer, rows)
        reader.accept(announce)
        if again.region == ref.region:
            break
        reader.release(again.region)
    with pytest.raises(CorruptRecord, match="stale"):
        reader.read(ref)
    big = type(ref)(again.region, again.gen, 0, np.dtype(np.float64), (ROWS + 1, VOCAB))
    with pytest.raises(CorruptRecord, match="overruns"):
        reader.read(big)
    with pytest.raises(CorruptRecord, match="cut short"):
        reader.accept(announce + b"\x01\x02")
    writer.close()
    reader.close()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_handle_opened_after_its_owner_died_names_pid_and_buffer(pair):
    writer, reader = _planes(pair, "cpu_ipc")
    writer.pid = _dead_pid()  # the announcement now names an exited owner
    ref, announce = _send(writer, np.ones((1, VOCAB)))
    with pytest.raises(IpcOwnerGone, match=f"buffer {ref.region} of process {writer.pid}") as err:
        reader.accept(announce)
    assert isinstance(err.value, TransportError) and (err.value.pid, err.value.buffer) == (writer.pid, ref.region)
    assert reader.opens == 0
    writer.close()


def test_rows_read_after_their_owner_died_are_refused(pair):
    alive = {"yes": True}
    writer, reader = _planes(pair, "cpu_ipc", alive=lambda pid: alive["yes"])
    ref, announce = _send(writer, np.ones((1, VOCAB)))
    reader.accept(announce)
    alive["yes"] = False  # (CUDA frees a dead process's memory: the cached buffer is no longer its rows)
    with pytest.raises(IpcOwnerGone, match="read after the owner exited"):
        reader.read(ref)
    writer.close()
    reader.close()


@pytest.mark.parametrize("kind", ["host", "cpu_ipc"])
def test_replies_carry_rows_through_either_plane(kind):
    server = listen("shm", **channel_options(kind, VOCAB, ROWS))
    client = connect(server.address)
    try:
        writer = writer_for(client, kind, "cpu", ROWS * VOCAB * 8)
        reader = reader_for(server, kind)
        frames = []
        for i in range(4):
            rows = np.full((3, VOCAB), float(i))
            frames.append(encode_reply(client, Reply(OK, DRAFT, b"body", probs=rows), writer))
            reply = decode_reply(server, frames[-1], VOCAB, reader)
            assert reply.body == b"body" and reply.probs.shape == (3, VOCAB) and (reply.probs == i).all()
            reader.release(reply.region)
        if kind == "cpu_ipc":  # the first reply per buffer is longer by its handle
            assert len(frames[0]) == len(frames[1]) > len(frames[2]) == len(frames[3])
            assert reader.opens == 2
        else:
            assert len({len(f) for f in frames}) == 1
        writer.close()
    finally:
        client.close()
        server.close()


def test_the_plane_choice():
    no, yes = (lambda: False), (lambda: True)
    assert choose_plane("auto", ["cpu"], "shm", yes) == "host"  # a CPU drafter
    assert choose_plane("auto", ["cuda:0"], "shm", no) == "host"  # torch sees no CUDA
    assert choose_plane("auto", ["cuda:0"], "tcp", yes) == "host"  # not the same host
    # auto keeps the arena even on a GPU: the engine verifies rows on the host today
    assert choose_plane("auto", ["cpu", "cuda:1"], "shm", yes) == "host"
    assert choose_plane("cuda_ipc", ["cpu", "cuda:1"], "shm", yes) == "cuda_ipc"
    with pytest.raises(TransportError, match="drafter on a CUDA device"):
        choose_plane("cuda_ipc", ["cpu"], "shm", yes)
    assert choose_plane("host", ["cuda:0"], "shm", yes) == "host"
    with pytest.raises(TransportError, match="needs CUDA"):
        choose_plane("cuda_ipc", ["cuda:0"], "shm", no)
    with pytest.raises(TransportError, match="shm transport"):
        choose_plane("cuda_ipc", ["cuda:0"], "pipe", yes)
    with pytest.raises(TransportError, match="not one of"):
        choose_plane("nvlink", ["cuda:0"], "shm", yes)
    assert resolve("auto", ["cpu"], "shm") == ("host", "cpu")
    if not _cuda():  # this host: the arena stays, and asking for CUDA IPC is a config error
        assert resolve("auto", ["cuda:0"], "shm") == ("host", "cpu")
        with pytest.raises(ConfigError, match="needs CUDA"):
            resolve("cuda_ipc", ["cuda:0"], "shm")
    else:
        assert resolve("cuda_ipc", ["cuda:1"], "shm") == ("cuda_ipc", "cuda:1")
