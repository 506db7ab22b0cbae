"""The buffers a device data plane (planes.py) shares between two processes.

A buffer kind is the only part of the plane that touches a device API:
  allocate(nbytes) -> a 1-D uint8 torch tensor           (producer)
  export(buf)      -> bytes: the handle that opens it      (producer, once per buffer)
  open(handle)     -> the same bytes in this process       (consumer, once per buffer)
  write(view, src) / flush() / to_host(view)               copies and their ordering

CudaBuffers: device memory from torch's caching allocator; the handle is the
cudaIpcMemHandle and ref-counter torch's own CUDA tensor sharing uses
(torch.multiprocessing.reductions.reduce_tensor / rebuild_cuda_tensor), packed
with struct, not pickled: records on the wire stay plain bytes.

SharedCpuBuffers: a stand-in for hosts without a GPU. Each buffer is a
hetero-sd shared-memory segment seen as a CPU tensor; the handle is its name.
Everything above the buffers (claims, generations, opening once, the dead-owner
check) is the same code for both, so a CPU host tests all of it but the two
CUDA calls.
"""
from __future__ import annotations

import struct

import numpy as np

from hetero_sd.transport.errors import TransportError

_CUDA_FIXED = struct.Struct("<iQQQ?")  # device, storage bytes, offset in the allocation, ref-counter offset, sync
_LEN = struct.Struct("<I")
_NONE = 0xFFFFFFFF


def _pack_bytes(value: bytes | None) -> bytes:
    return _LEN.pack(_NONE) if value is None else _LEN.pack(len(value)) + bytes(value)


def _unpack_bytes(buf: bytes, at: int) -> tuple[bytes | None, int]:
    (n,) = _LEN.unpack_from(buf, at)
    at += _LEN.size
    if n == _NONE:
        return None, at
    if at + n > len(buf):
        raise TransportError(f"CUDA IPC handle of {len(buf)} bytes is cut short")
    return bytes(buf[at:at + n]), at + n


class CudaBuffers:
    """Device buffers on `device`, shared through CUDA IPC handles."""

    kind = "cuda_ipc"

    def __init__(self, device: str = "cuda"):
        import torch

        self.torch, self.device = torch, torch.device(device)

    def allocate(self, nbytes: int):
        return self.torch.empty(nbytes, dtype=self.torch.uint8, device=self.device)

    def export(self, buf) -> bytes:
        from torch.multiprocessing.reductions import reduce_tensor

        _, args = reduce_tensor(buf)  # (the rebuild arguments: see rebuild_cuda_tensor)
        device, handle, size, offset, _grad, rc_handle, rc_offset, event, sync = args[6:15]
        return (_CUDA_FIXED.pack(device, size, offset, rc_offset, bool(sync))
                + _pack_bytes(handle) + _pack_bytes(rc_handle) + _pack_bytes(event))

    def open(self, handle: bytes):
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        torch = self.torch
        device, size, offset, rc_offset, sync = _CUDA_FIXED.unpack_from(handle, 0)
        mem, at = _unpack_bytes(handle, _CUDA_FIXED.size)
        rc_handle, at = _unpack_bytes(handle, at)
        event, at = _unpack_bytes(handle, at)
        return rebuild_cuda_tensor(torch.Tensor, (size,), (1,), 0, torch.storage.TypedStorage, torch.uint8,
                                   device, mem, size, offset, False, rc_handle, rc_offset, event, sync)

    def write(self, view, src) -> None:
        # a torch tensor (the drafter's rows on its GPU) copies device to device
        data = src if isinstance(src, self.torch.Tensor) else self.torch.from_numpy(np.ascontiguousarray(src))
        view.copy_(data, non_blocking=True)

    def flush(self) -> None:
        # the record that names the bytes is sent (or the region released) only
        # once the copies into (or out of) them are done
        self.torch.cuda.synchronize(self.device)

    def to_host(self, view) -> np.ndarray:
        return view.cpu().numpy()

    def close(self) -> None:
        pass  # the buffers go with the plane's references (and the process)


class SharedCpuBuffers:
    """CPU tensors over shared-memory segments: CUDA IPC's stand-in without a GPU."""

    kind = "cpu_ipc"

    def __init__(self, device: str = "cpu"):
        import torch

        self.torch, self._segments = torch, []

    def allocate(self, nbytes: int):
        from hetero_sd.transport.segment import Segment

        seg = Segment.create(nbytes)
        self._segments.append(seg)
        return self.torch.frombuffer(seg.buf, dtype=self.torch.uint8)

    def export(self, buf) -> bytes:
        address = buf.data_ptr()
        for seg in self._segments:
            if self.torch.frombuffer(seg.buf, dtype=self.torch.uint8).data_ptr() == address:
                return seg.name.encode()
        raise TransportError("buffer was not allocated by this SharedCpuBuffers")

    def open(self, handle: bytes):
        from hetero_sd.transport.segment import Segment

        seg = Segment.attach(handle.decode())
        self._segments.append(seg)
        return self.torch.frombuffer(seg.buf, dtype=self.torch.uint8)

    def write(self, view, src) -> None:
        data = src if isinstance(src, self.torch.Tensor) else self.torch.from_numpy(np.ascontiguousarray(src))
        view.copy_(data)

    def flush(self) -> None:
        pass  # CPU stores are ordered by the ring's release/acquire, as the host arena's

    def to_host(self, view) -> np.ndarray:
        arr = view.numpy()  # zero-copy: the segment is already host memory
        arr.flags.writeable = False
        return arr

    def close(self) -> None:
        segments, self._segments = self._segments, []
        for seg in segments:
            seg.close()


BUFFER_KINDS = {"cuda_ipc": CudaBuffers, "cpu_ipc": SharedCpuBuffers}
