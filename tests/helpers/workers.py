"""Worker drafters for tests, with faults injected from outside the runtime.

    remote(spec, vocab, transport="shm")                              a RemoteDrafter, the runtime's worker
    remote(spec, vocab, fault=FaultSpec(after=3, kind="exit"))        its worker kills itself after 3 drafts

The faulty worker is the runtime's worker loop (hetero_sd.drafting.worker.main)
with a Handler subclass that misbehaves after `after` draft requests answered
normally: `exit` (SIGKILL to itself), `hang`, reply `malformed` bytes, or
raise an `error` it reports. It is a picklable process target, so it runs in
a real worker process (forkserver or spawn) like the production one.
"""
from __future__ import annotations

import os
import signal
import struct
import time
from dataclasses import dataclass
from functools import partial

from hetero_sd.drafting import worker
from hetero_sd.drafting.build import build_drafter, worker_entry
from hetero_sd.drafting.remote import RemoteDrafter
from hetero_sd.ir.work import DraftRequest


@dataclass(frozen=True)
class FaultSpec:
    after: int  # draft requests answered normally first
    kind: str = "exit"  # exit | hang | malformed | error


class FaultyHandler(worker.Handler):
    def __init__(self, *args, fault: FaultSpec):
        super().__init__(*args)
        self.fault, self.answered = fault, 0

    def __call__(self, msg: bytes) -> bytes:
        if struct.unpack_from("<i", msg)[0] == DraftRequest.KIND and self.load_error is None:
            self.answered += 1
            if self.answered > self.fault.after:
                if self.fault.kind == "exit":
                    os.kill(os.getpid(), signal.SIGKILL)
                if self.fault.kind == "hang":
                    time.sleep(3600)
                if self.fault.kind == "malformed":
                    return b"\x01\x00\x00\x00garbage"
        return super().__call__(msg)

    def _draft(self, req):
        if self.fault.kind == "error" and self.answered > self.fault.after:
            raise RuntimeError(f"injected worker failure after {self.fault.after} drafts")
        return super()._draft(req)


def faulty_main(spec, address, options, *, fault: FaultSpec, in_process: bool = False) -> None:
    worker.main(spec, address, options, build=build_drafter, in_process=in_process,
                handler_type=partial(FaultyHandler, fault=fault))


def remote(spec, vocab: int, fault: FaultSpec | None = None, **kw) -> RemoteDrafter:
    if fault is not None and fault.kind == "exit" and kw.get("transport") == "inproc":
        raise ValueError("an in-process (thread) worker cannot exit alone; use a process transport")
    entry = worker_entry() if fault is None else partial(faulty_main, fault=fault)
    return RemoteDrafter(spec, vocab, entry=entry, **kw)
