"""The cuda backend: devices `cuda:N` (by probe), and `cpu` under Triton's interpreter.

Every precision is exact (batch-invariant): the kernels fix each reduction
order by the model's shapes (kernels.py). `TRITON_INTERPRET=1` (read by
Triton itself when it is imported) runs the same kernels on CPU tensors; the
backend then also offers `device: cpu`, slowly, for tests and for reading
the kernels' results where no GPU is at hand.
"""
from __future__ import annotations

import os

from hetero_sd.backends.base import API_VERSION, DeviceInfo, PrecisionInfo, resolve
from hetero_sd.ir.errors import BackendError
from hetero_sd.ir.model import ModelIR

NOTE = "Triton kernels with reduction orders fixed by the model's shapes"
INSTALL = ("backend 'cuda' needs torch and Triton: on a GPU host install the torch build for "
           "your CUDA (it brings Triton), or `pip install triton` beside a CPU torch to run the "
           "kernels interpreted (TRITON_INTERPRET=1, device: cpu)")


def _runtime():
    """(torch, triton), or None where either is missing."""
    try:
        import torch
        import triton  # noqa: F401
    except ImportError:
        return None
    return torch, triton


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


def _precisions(bf16: bool) -> tuple[tuple[PrecisionInfo, ...], tuple[tuple[str, str], ...]]:
    out = [PrecisionInfo("fp16", True, NOTE), PrecisionInfo("fp32", True, NOTE),
           PrecisionInfo("gguf", True, "the GGUF file's own blocks, dequantized inside the matmul; " + NOTE)]
    if bf16:
        return (PrecisionInfo("bf16", True, NOTE), *out), ()
    return tuple(out), (("bf16", "needs compute capability 8.0 (Ampere) or newer"),)


class CudaBackend:
    name = "cuda"
    api_version = API_VERSION

    def probe(self) -> list[DeviceInfo]:
        rt = _runtime()
        if rt is None:
            return []
        torch, triton = rt
        devices = []
        if not interpreting() and torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                major, minor = torch.cuda.get_device_capability(i)
                precs, lacks = _precisions(major >= 8)
                desc = f"{torch.cuda.get_device_name(i)} (compute capability {major}.{minor}, Triton {triton.__version__})"
                devices.append(DeviceInfo(self.name, f"cuda:{i}", desc, precs, precs[0].name, lacks))
        if interpreting():
            precs, _ = _precisions(True)
            devices.append(DeviceInfo(self.name, "cpu", f"Triton {triton.__version__} interpreter on the host "
                                      "CPU (TRITON_INTERPRET=1: for tests, slow)", precs, "bf16"))
        return devices

    def load(self, model: ModelIR, device: str, precision: str, kv_budget_bytes: int, progress=None):
        rt = _runtime()
        if rt is None:
            raise BackendError(INSTALL)
        torch = rt[0]
        info, prec = resolve(self.probe(), self.name, device, precision)
        from hetero_sd.backends.cuda.runner import CudaRunner

        bf16 = info.precision("bf16") is not None
        dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
                 "gguf": torch.bfloat16 if bf16 else torch.float16}[prec.name]
        return CudaRunner(model, info, prec, dtype, kv_budget_bytes, progress)
