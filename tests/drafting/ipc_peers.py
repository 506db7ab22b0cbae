"""Worker entries for test_remote_ipc.py (importable by a spawned worker process)."""
from __future__ import annotations

import os
import signal
import struct

from hetero_sd.drafting import worker
from hetero_sd.drafting.build import build_drafter
from hetero_sd.ir.work import DraftRequest


class DieAfterFirstDraft(worker.Handler):
    """Sends its first draft reply (the one announcing its buffers), then dies (kill -9)."""

    def __call__(self, msg: bytes) -> bytes:
        frame = super().__call__(msg)
        if struct.unpack_from("<i", msg)[0] == DraftRequest.KIND:
            self.channel.send(frame, timeout=30.0)
            os.kill(os.getpid(), signal.SIGKILL)
        return frame


def dying_main(spec, address, options, *, in_process: bool = False) -> None:
    worker.main(spec, address, options, build=build_drafter, in_process=in_process,
                handler_type=DieAfterFirstDraft)
