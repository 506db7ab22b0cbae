"""Data planes: where a reply's tensors travel while the shm ring carries its record.

Two planes, one protocol (a writer in the producer, a reader in the consumer):
  writer.claim(timeout) -> lease; lease.alloc(shape, dtype) -> (TensorRef, view)
  writer.write(view, src); writer.flush(); writer.announcements() -> bytes
  reader.accept(announcements); reader.read(ref) -> numpy; reader.release(region)

- "host": the channel's shared-memory Arena (arena.py); rows are written in
  place and read as a zero-copy numpy view. The default, and the only plane
  off a GPU.
- "cuda_ipc" (and "cpu_ipc", its stand-in on hosts without one): the producer
  allocates one buffer per region on its device and exports each buffer's
  handle once; the handle rides in the first record that refers to the buffer
  (an announcement: producer pid, buffer id, epoch, size, handle). The consumer
  opens it once and caches it by (pid, buffer, epoch); records then carry only
  a TensorRef (buffer id = region, generation, offset, dtype, shape).

The claim/release protocol is the arena's own: a device plane keeps its region
states in the channel's arena (created with control words only) and its bytes
in the device buffers, so a region is never rewritten while the reader holds
it, and a stale generation is refused the same way.

A buffer whose owner has died cannot be trusted (CUDA frees its memory with
the process): opening or reading one raises IpcOwnerGone, a TransportError,
so a RemoteDrafter fails the call and the engine goes on without the drafter.
"""
from __future__ import annotations

import itertools
import os
import struct
from typing import Callable

import numpy as np

from hetero_sd.ir.errors import ConfigError
from hetero_sd.transport.arena import Arena, TensorRef
from hetero_sd.transport.errors import CorruptRecord, TransportError
from hetero_sd.transport.ipc_buffers import BUFFER_KINDS
from hetero_sd.transport.segment import pid_alive

PLANES = ("auto", "host", "cuda_ipc")  # what a config may ask for
STAND_IN = "cpu_ipc"  # tests and benchmarks only: the CUDA plane's code over shared CPU memory
_ANNOUNCE = struct.Struct("<IHIQI")  # pid, buffer, epoch, buffer bytes, handle bytes
_EPOCHS = itertools.count(1)


class IpcOwnerGone(TransportError):
    """A device buffer's owner process died: its handle cannot be opened or read."""

    def __init__(self, pid: int, buffer: int, why: str = ""):
        self.pid, self.buffer = pid, buffer
        super().__init__(f"data-plane buffer {buffer} of process {pid}: its owner died, so its "
                         f"memory is gone{'; ' + why if why else ''}")


def choose_plane(requested: str, devices, transport: str, cuda_available: Callable[[], bool]) -> str:
    """The plane a worker uses. auto: the host arena. The engine verifies draft rows on the
    host today, so rows through CUDA IPC would cross to the device in the worker and back in
    the engine: more copies than the arena's one. cuda_ipc: where the drafter sits on a CUDA
    device, torch sees CUDA, and the target is on the same host (the shm transport)."""
    if requested not in PLANES + (STAND_IN,):
        raise TransportError(f"data plane {requested!r} is not one of {', '.join(PLANES)}")
    if requested in ("host", "auto"):
        return "host"
    if requested == "cuda_ipc" and not any(str(d).startswith("cuda") for d in devices):
        raise TransportError(f"data plane cuda_ipc needs a drafter on a CUDA device; it runs on "
                             f"{', '.join(map(str, devices)) or 'no device'}")
    if transport != "shm":
        raise TransportError(f"data plane {requested} needs the shm transport (one host); got {transport}")
    if requested == STAND_IN:
        return STAND_IN
    if not cuda_available():
        raise TransportError("data plane cuda_ipc needs CUDA, and torch sees no CUDA device here")
    return "cuda_ipc"


def resolve(requested: str, devices, transport: str) -> tuple[str, str]:
    """(plane, device of its buffers) for a worker whose drafter sits on `devices`;
    a plane that cannot be had here is a ConfigError."""
    try:
        kind = choose_plane(requested, devices, transport, torch_available_cuda)
    except TransportError as exc:
        raise ConfigError(f"worker {exc}") from None
    cuda = [str(d) for d in devices if str(d).startswith("cuda")]
    return kind, cuda[0] if kind == "cuda_ipc" and cuda else "cpu"


def torch_available_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# ----------------------------------------------------------------------------- host arena
class HostWriter:
    """The channel's arena as a plane (nothing to announce, nothing to flush)."""

    def __init__(self, arena: Arena):
        self.arena = arena

    def claim(self, timeout: float | None = None):
        return self.arena.claim(timeout)

    def write(self, view, src) -> None:
        view[...] = src

    def flush(self) -> None:
        pass

    def announcements(self) -> bytes:
        return b""

    def close(self) -> None:
        pass


class HostReader:
    def __init__(self, arena: Arena):
        self.arena = arena

    def accept(self, blob: bytes) -> None:
        if blob:
            raise CorruptRecord(f"{len(blob)} bytes of buffer announcements on a host-arena channel")

    def read(self, ref: TensorRef) -> np.ndarray:
        return self.arena.view(ref)

    def release(self, region: int) -> None:
        self.arena.release(region)

    def close(self) -> None:
        pass  # (the arena goes with its channel)


# ----------------------------------------------------------------------------- device buffers
class DeviceLease:
    def __init__(self, writer: "DeviceWriter", region: int, gen: int):
        self.writer, self.region, self.gen, self.used = writer, region, gen, 0

    def alloc(self, shape, dtype=np.float32):
        """A writable tensor of `shape` in this region's buffer and the ref to send for it."""
        shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(d) for d in shape)
        dtype = np.dtype(dtype)
        offset = -(-self.used // 64) * 64
        ref = TensorRef(self.region, self.gen, offset, dtype, shape)
        ref.pack()  # (refuses what a record cannot carry)
        if offset + ref.nbytes > self.writer.region_bytes:
            raise TransportError(f"device buffer of {self.writer.region_bytes} bytes cannot hold {dtype} {shape} "
                                 f"after {offset} bytes already used")
        self.used = offset + ref.nbytes
        self.writer.pending.add(self.region)
        return ref, _typed(self.writer.buffers_[self.region], ref)


def _typed(buf, ref: TensorRef):
    """A view of `ref`'s bytes in `buf` (a uint8 torch tensor) as its dtype and shape."""
    import torch

    raw = buf[ref.offset:ref.offset + ref.nbytes]
    return raw.view(getattr(torch, ref.dtype.name)).view(ref.shape)  # (arena dtypes share torch's names)


class DeviceWriter:
    """The producer's half: one device buffer per region of the control arena."""

    def __init__(self, control: Arena, buffers, region_bytes: int):
        self.control, self.buffers, self.region_bytes = control, buffers, region_bytes
        # (pid, buffer, epoch) names one allocation: a second writer in this process is a new epoch
        self.epoch, self.pid = next(_EPOCHS), os.getpid()
        self.buffers_ = [buffers.allocate(region_bytes) for _ in range(control.n_regions)]
        self.announced: set[int] = set()
        self.pending: set[int] = set()  # buffers the next record refers to

    def claim(self, timeout: float | None = None) -> DeviceLease:
        lease = self.control.claim(timeout)
        return DeviceLease(self, lease.region, lease.gen)

    def write(self, view, src) -> None:
        self.buffers.write(view, src)

    def flush(self) -> None:
        self.buffers.flush()

    def announcements(self) -> bytes:
        """Handles of the buffers the next record refers to for the first time (each once)."""
        out = []
        for i in sorted(self.pending - self.announced):
            handle = self.buffers.export(self.buffers_[i])
            out.append(_ANNOUNCE.pack(self.pid, i, self.epoch, self.region_bytes, len(handle)) + handle)
            self.announced.add(i)
        self.pending.clear()
        return b"".join(out)

    def close(self) -> None:
        self.buffers_ = []
        self.buffers.close()


class DeviceReader:
    """The consumer's half: opens each announced buffer once and reuses it."""

    def __init__(self, control: Arena, buffers, alive: Callable[[int], bool] = pid_alive):
        self.control, self.buffers, self.alive = control, buffers, alive
        self.opened: dict[tuple[int, int, int], tuple[object, int]] = {}  # (pid, buffer, epoch) -> (buf, bytes)
        self.current: dict[int, tuple[int, int, int]] = {}  # buffer id -> the key its refs mean now
        self.opens = 0  # handles opened (tests: once per buffer)

    def accept(self, blob: bytes) -> None:
        at = 0
        while at < len(blob):
            if at + _ANNOUNCE.size > len(blob):
                raise CorruptRecord(f"buffer announcement cut short at byte {at} of {len(blob)}")
            pid, buffer, epoch, nbytes, n = _ANNOUNCE.unpack_from(blob, at)
            handle, at = bytes(blob[at + _ANNOUNCE.size:at + _ANNOUNCE.size + n]), at + _ANNOUNCE.size + n
            if len(handle) != n or buffer >= self.control.n_regions:
                raise CorruptRecord(f"announcement of buffer {buffer} ({n}-byte handle) does not fit "
                                    f"{self.control.n_regions} regions / its record")
            key = (pid, buffer, epoch)
            if key not in self.opened:
                self.opened[key] = (self._open(pid, buffer, handle), nbytes)
                self.opens += 1
            self.current[buffer] = key

    def _open(self, pid: int, buffer: int, handle: bytes):
        if not self.alive(pid):
            raise IpcOwnerGone(pid, buffer, "its handle was opened after the owner exited")
        try:
            return self.buffers.open(handle)
        except Exception as exc:  # a handle that no longer opens: its owner freed it
            if not self.alive(pid):
                raise IpcOwnerGone(pid, buffer, f"opening its handle failed: {exc}") from None
            raise TransportError(f"data-plane buffer {buffer} of process {pid} did not open: {exc}") from exc

    def view(self, ref: TensorRef):
        """The device tensor `ref` names (zero-copy), after the arena's generation check."""
        self.control.check(ref)
        key = self.current.get(ref.region)
        if key is None:
            raise CorruptRecord(f"tensor ref names buffer {ref.region}, which was never announced")
        if not self.alive(key[0]):
            raise IpcOwnerGone(key[0], ref.region, "the rows it held were read after the owner exited")
        buf, nbytes = self.opened[key]
        if ref.offset < 0 or ref.offset + ref.nbytes > nbytes:
            raise CorruptRecord(f"tensor ref {ref.shape} {ref.dtype} at {ref.offset} overruns "
                                f"its {nbytes}-byte buffer")
        return _typed(buf, ref)

    def read(self, ref: TensorRef) -> np.ndarray:
        """The rows for the host-side verifier (one device-to-host copy under CUDA)."""
        return self.buffers.to_host(self.view(ref))

    def release(self, region: int) -> None:
        self.buffers.flush()  # the consumer's copies out of the region are done first
        self.control.release(region)

    def close(self) -> None:
        self.opened, self.current = {}, {}
        self.buffers.close()


# ----------------------------------------------------------------------------- factories
def region_bytes(vocab: int, max_rows: int, itemsize: int = 8) -> int:
    """A region that holds `max_rows` rows of `vocab` (page-rounded)."""
    return -(-max_rows * vocab * itemsize // 4096) * 4096


def channel_options(kind: str, vocab: int, max_rows: int, regions: int = 2) -> dict:
    """listen("shm", ...) options: a host plane's arena holds the rows; a device plane's
    holds control words only (one page a region), its rows live on the device."""
    size = region_bytes(vocab, max_rows) if kind == "host" else 1
    return {"arena_regions": regions, "arena_region_bytes": size}


def writer_for(channel, kind: str, device: str, size: int):
    """The producer's plane over `channel` (None: no arena; rows go inline)."""
    control = channel.tx_arena
    if control is None:
        return None
    if kind == "host":
        return HostWriter(control)
    return DeviceWriter(control, BUFFER_KINDS[kind](device), size)


def reader_for(channel, kind: str):
    control = channel.rx_arena
    if control is None:
        return None
    return HostReader(control) if kind == "host" else DeviceReader(control, BUFFER_KINDS[kind]())
