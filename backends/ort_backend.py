"""The onnxruntime backend: the IR lowered to ONNX (cached on disk), run by an
execution provider chosen from the device string: cpu -> CPU, cuda:N -> CUDA,
npu:N -> CANN (Ascend). Weight-only int8/int4 use onnxruntime's own
MatMulNBits quantizer; the LM head stays at 8 bits or more (4-bit breaks it)."""
from __future__ import annotations

import os

from hetero_sd.backends.base import API_VERSION, DeviceInfo, PrecisionInfo, resolve
from hetero_sd.ir.cache import cache_dir, cached
from hetero_sd.backends.graph_runner import GraphRunner
from hetero_sd.backends.onnx_llama import GRAPH_VERSION, build_llama_onnx
from hetero_sd.ir.model import ModelIR

_PROVIDERS = {"CUDAExecutionProvider": "cuda", "CANNExecutionProvider": "npu"}
_EXACT = "MLAS kernels are row-invariant (tested)"


def _cpu_precisions() -> tuple[PrecisionInfo, ...]:
    # MatMulNBits' one-row path rounds apart from its multi-row kernel, so
    # one-token calls run padded to two rows (graph_runner.py).
    return (PrecisionInfo("fp32", True, _EXACT),
            PrecisionInfo("int8", True, "weight-only MatMulNBits 8-bit, one-token calls padded"),
            PrecisionInfo("int4", True, "weight-only MatMulNBits 4-bit (LM head 8-bit), one-token calls padded"))


class OrtBackend:
    name = "onnxruntime"
    api_version = API_VERSION

    def probe(self) -> list[DeviceInfo]:
        try:
            import onnxruntime as ort
        except Exception:
            return []
        desc = f"onnxruntime {ort.__version__}"
        devices = [DeviceInfo(self.name, "cpu", f"{desc} CPUExecutionProvider", _cpu_precisions(), "fp32")]
        for provider in ort.get_available_providers():
            if provider in _PROVIDERS:
                note = "provider kernels chosen by shape; lossless up to numerics"
                devices.append(DeviceInfo(self.name, f"{_PROVIDERS[provider]}:0", f"{desc} {provider}",
                                          (PrecisionInfo("fp32", False, note),), "fp32"))
        return devices

    def load(self, model: ModelIR, device: str, precision: str, kv_budget_bytes: int,
             progress=None) -> "OrtRunner":
        info, prec = resolve(self.probe(), self.name, device, precision)
        return OrtRunner(model, info, prec, kv_budget_bytes, progress)


def export_onnx(model: ModelIR, precision: str, progress=None):
    """The model's ONNX file for this precision, built once and cached."""
    import onnx
    import onnxruntime as ort

    folder = cache_dir("onnx", model, graph=GRAPH_VERSION, precision=precision,
                       onnx=onnx.__version__, ort=ort.__version__)

    def build(path):
        proto = build_llama_onnx(model, progress)
        if precision in ("int8", "int4"):
            if progress is not None:
                progress(0, 0, f"quantizing weights to {precision} (once; cached)")
            proto = _quantize(proto, 8 if precision == "int8" else 4)
        onnx.save_model(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location="weights.bin", size_threshold=1024)

    return cached(folder, "model.onnx", build)


def _quantize(proto, bits: int):
    import logging

    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)  # one line per node otherwise

    # The LM head (the node writing "logits") stays 8-bit: at 4 bits it breaks the output.
    nodes = [n.name for n in proto.graph.node if "logits" in n.output] if bits < 8 else []
    quant = MatMulNBitsQuantizer(proto, block_size=32, is_symmetric=True, bits=bits,
                                 nodes_to_exclude=nodes, accuracy_level=4)
    quant.process()
    out = quant.model.model
    if nodes:  # the tied/untied LM head: 8-bit rather than fp32
        out = MatMulNBitsQuantizer(out, block_size=32, is_symmetric=True, bits=8, accuracy_level=4)
        out.process()
        out = out.model.model
    return out


class OrtRunner(GraphRunner):
    def __init__(self, model: ModelIR, info: DeviceInfo, precision: PrecisionInfo, kv_budget_bytes: int,
                 progress=None):
        import onnxruntime as ort

        super().__init__(model, info, precision, kv_budget_bytes,
                         pad_single_row=precision.name in ("int8", "int4"))
        path = export_onnx(model, precision.name, progress)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = len(os.sched_getaffinity(0))
        opts.log_severity_level = 3
        provider = next((p for p, d in _PROVIDERS.items() if info.device.startswith(d)), "CPUExecutionProvider")
        self._session = ort.InferenceSession(str(path), opts, providers=[provider])
        self._outputs = [o.name for o in self._session.get_outputs()]

    def _infer(self, feeds: dict, past: dict) -> list:
        return self._session.run(self._outputs, feeds | past)
