"""The torch backend: CPU here, CUDA and Ascend NPU (torch-npu) by device string.

The runner (torch_runner.py) executes the IR's reference forward itself (so it is the reference
on the reference's own terms), with weights cast to the precision and a KV
pool pre-allocated to the configured budget. Device quirks stay in this file.
"""
from __future__ import annotations

from hetero_sd.backends.base import API_VERSION, DeviceInfo, PrecisionInfo, resolve
from hetero_sd.ir.model import ModelIR


def _cpu_precisions() -> tuple[PrecisionInfo, ...]:
    import torch

    # Batch invariance on CPU comes from calibrated row-chunked matmuls and
    # row-wise attention (torch_numerics.py), proven bitwise by the tests.
    note = "row-stable matmul calibrated at load"
    out = [PrecisionInfo("fp32", True, note)]
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        out.append(PrecisionInfo("bf16", True, note))
    return tuple(out)


def _accel_precisions(bf16: bool) -> tuple[PrecisionInfo, ...]:
    # cuBLAS / CANN choose kernels by shape: verify and decode may round apart.
    note = "kernels chosen by shape; lossless up to numerics"
    out = [PrecisionInfo("fp16", False, note), PrecisionInfo("fp32", False, note)]
    if bf16:
        out.insert(0, PrecisionInfo("bf16", False, note))
    return tuple(out)


def _npu_module():
    import torch

    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except Exception:
        return None
    return getattr(torch, "npu", None)


class TorchBackend:
    name = "torch"
    api_version = API_VERSION

    def probe(self) -> list[DeviceInfo]:
        import torch  # here, not at import: an engine on another backend never loads torch

        cpu = DeviceInfo(self.name, "cpu", "host CPU (torch %s, %s)" % (
            torch.__version__, torch.backends.cpu.get_cpu_capability()), _cpu_precisions(), "fp32")
        devices = [cpu]
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                precs = _accel_precisions(torch.cuda.is_bf16_supported())
                devices.append(DeviceInfo(self.name, f"cuda:{i}", torch.cuda.get_device_name(i),
                                          precs, precs[0].name))
        npu = _npu_module()
        if npu is not None and npu.is_available():
            for i in range(npu.device_count()):
                devices.append(DeviceInfo(self.name, f"npu:{i}", "Ascend NPU (torch-npu)",
                                          _accel_precisions(True), "fp16"))
        return devices

    def load(self, model: ModelIR, device: str, precision: str, kv_budget_bytes: int,
             progress=None):
        from hetero_sd.backends.torch_runner import TorchRunner

        info, prec = resolve(self.probe(), self.name, device, precision)
        return TorchRunner(model, info, prec, kv_budget_bytes, progress)
