"""The OpenVINO backend: the same ONNX lowering as onnxruntime, read and
compiled by OpenVINO for CPU / GPU / NPU. Targets run the batch-invariant
hints by default (f32 inference precision, no dynamic activation
quantisation): OpenVINO's CPU defaults (bf16, dynamic int8 activations) round
a multi-token verify differently from one-token decode and break lossless
output. Past KV is bound zero-copy from the backend's pool."""
from __future__ import annotations

import numpy as np

from hetero_sd.backends.base import API_VERSION, DeviceInfo, PrecisionInfo, resolve
from hetero_sd.ir.cache import cache_root
from hetero_sd.backends.graph_runner import GraphRunner
from hetero_sd.backends.options import DEFAULT as DEFAULT_OPTIONS, BackendOptions
from hetero_sd.backends.ort_backend import export_onnx
from hetero_sd.ir.model import ModelIR

# precision -> (compile properties, batch-invariant, note)
_CPU_POLICY = {
    "fp32": ({"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}, True,
             "f32 compute, no dynamic quantisation"),
    "bf16": ({"INFERENCE_PRECISION_HINT": "bf16", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}, True,
             "bf16 compute, no dynamic quantisation"),
    "int8": ({"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}, True,
             "u8 compressed weights (block 32), f32 compute, one-token calls padded unless a check at load "
             "finds one row exact on this host"),
    "int4": ({"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}, True,
             "u4 compressed weights (blocks of 128 where the model allows, else 32; LM head u8), f32 compute, "
             "calls padded (one row, or odd widths) as a check at load finds exact on this host"),
    "gguf": ({"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}, True,
             "a GGUF's own blocks as u4/u8 compressed constants with their scales and zero points, "
             "block minimums as their own matmul: bit-exact weights (types without a block form, fp32); "
             "f32 compute, one-token calls padded unless a check at load "
             "finds one row exact on this host"),
    "default": ({}, False, "OpenVINO's own defaults (bf16/dynamic int8 on CPU); lossless up to numerics"),
}
_COMPRESSED = ("int8", "int4", "gguf")  # read from the ONNX lowering's MatMulNBits as compressed constants


def _precisions(device: str, caps: list[str]) -> tuple[PrecisionInfo, ...]:
    if device == "CPU":
        names = ["fp32"] + (["bf16"] if "BF16" in caps else []) + list(_COMPRESSED)
        names.append("default")
        return tuple(PrecisionInfo(n if n != "default" else "ov-default", _CPU_POLICY[n][1], _CPU_POLICY[n][2])
                     for n in names)
    note = "device kernels chosen by shape; lossless up to numerics"
    return (PrecisionInfo("fp16", False, note), PrecisionInfo("fp32", False, note))


class OpenVINOBackend:
    name = "openvino"
    api_version = API_VERSION
    takes_options = True

    def __init__(self, options: BackendOptions = DEFAULT_OPTIONS):
        self.options = options  # its runners' unless a load names its own

    def probe(self) -> list[DeviceInfo]:
        try:
            import openvino as ov
        except Exception:
            return []
        core, devices = ov.Core(), []
        for dev in core.available_devices:
            try:
                caps = list(core.get_property(dev, "OPTIMIZATION_CAPABILITIES"))
                full = core.get_property(dev, "FULL_DEVICE_NAME")
            except Exception:  # a device that cannot even report itself is skipped
                continue
            precs = _precisions(dev, caps)
            devices.append(DeviceInfo(self.name, dev, f"OpenVINO {ov.__version__} {full}", precs, precs[0].name))
        return devices

    def load(self, model: ModelIR, device: str, precision: str, kv_budget_bytes: int,
             progress=None, options: BackendOptions | None = None) -> "OpenVINORunner":
        """options: its padding (pad_single_row); the kernel keys are onnxruntime's."""
        info, prec = resolve(self.probe(), self.name, device, precision)
        return OpenVINORunner(model, info, prec, kv_budget_bytes, progress, options or self.options)


class OpenVINORunner(GraphRunner):
    def __init__(self, model: ModelIR, info: DeviceInfo, precision: PrecisionInfo, kv_budget_bytes: int,
                 progress=None, options: BackendOptions = DEFAULT_OPTIONS):
        import openvino as ov

        super().__init__(model, info, precision, kv_budget_bytes, pad_single_row=precision.name in _COMPRESSED,
                         options=options)
        # OpenVINO's ONNX frontend reads MatMulNBits into u4/u8 constants with
        # scale and zero point (a decompression its CPU plugin fuses into the
        # matmul), so one lowering serves both runtimes, streamed to disk
        # tensor by tensor: no float copy of a compressed model is ever made.
        path = export_onnx(model, precision.name if precision.name in _COMPRESSED else "fp32", progress)
        core = ov.Core()
        # OpenVINO keeps compiled blobs here and reuses them on the next load.
        core.set_property({"CACHE_DIR": str(cache_root() / "openvino-blobs")})
        if info.device == "CPU":
            props = dict(_CPU_POLICY["default" if precision.name == "ov-default" else precision.name][0])
        else:
            props = {"INFERENCE_PRECISION_HINT": "f16" if precision.name == "fp16" else "f32"}
        self._compiled = core.compile_model(core.read_model(str(path)), info.device, props)
        self._request = self._compiled.create_infer_request()
        self._outputs = list(self._compiled.outputs)
        self._bound: dict | None = None  # the past views bound now (GraphRunner keeps one dict per sequence)
        self._feed_bufs: dict[str, np.ndarray] = {}  # bound per-step inputs, rewritten in place
        self.settle_padding(path, f"openvino {ov.__version__} {info.device} {sorted(props.items())}")

    def _infer(self, feeds: dict, past: dict) -> list:
        import openvino as ov

        req = self._request
        if self._bound is not past:
            # A sequence's slab views are bound once (zero-copy: they outlive
            # every call) and stay bound until another sequence runs.
            for name, array in past.items():
                req.set_tensor(name, ov.Tensor(array, shared_memory=True))
            self._bound = past
        for name, array in feeds.items():
            # The small per-step inputs live in buffers bound once and
            # rewritten in place while their shape holds (a set_tensor costs
            # more than the copy); a new shape binds a new buffer.
            buf = self._feed_bufs.get(name)
            if buf is None or buf.shape != array.shape:
                buf = self._feed_bufs[name] = array.copy()
                req.set_tensor(name, ov.Tensor(buf, shared_memory=True))
            else:
                np.copyto(buf, array)
        req.start_async()  # start+wait skips the Python wrapper's dict of all outputs
        req.wait()
        # Views: the runner copies K/V into its slab and slices the logits at once.
        return [req.get_tensor(out).data for out in self._outputs]
