"""The cuda backend's tests run on a GPU where one is, else on the interpreter's `cpu`
device (TRITON_INTERPRET=1, set by tests/conftest.py): the same kernels either way."""
from __future__ import annotations

import pytest
import torch

from hetero_sd.backends.cuda.backend import CudaBackend, interpreting

GPU = torch.cuda.is_available() and not interpreting()
DEVICE = "cuda:0" if GPU else "cpu"


def cuda_device() -> str:
    devices = [d.device for d in CudaBackend().probe()]
    if DEVICE not in devices:
        pytest.fail(f"the cuda backend offers {devices}, not {DEVICE}: install the test extra (triton) "
                    "and run under TRITON_INTERPRET=1 where no GPU is")
    return DEVICE
