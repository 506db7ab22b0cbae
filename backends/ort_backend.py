"""The onnxruntime backend: the IR lowered to ONNX (cached on disk), run by an
execution provider chosen from the device string: cpu -> CPU, cuda:N -> CUDA,
npu:N -> CANN (Ascend). Weight-only int8/int4 use onnxruntime's own
MatMulNBits quantizer; the LM head stays at 8 bits or more (4-bit breaks it)."""
from __future__ import annotations

import os

from typing import Sequence

import numpy as np

from hetero_sd.backends.base import API_VERSION, BatchItem, DeviceInfo, PrecisionInfo, resolve
from hetero_sd.ir.cache import cache_dir, cached
from hetero_sd.backends.graph_runner import GraphRunner
from hetero_sd.backends.graph_version import GRAPH_VERSION
from hetero_sd.ir.model import ModelIR

_PROVIDERS = {"CUDAExecutionProvider": "cuda", "CANNExecutionProvider": "npu"}
_EXACT = "MLAS kernels are row-invariant (tested)"
GGUF_NOTE = ("a GGUF's own blocks, bit-exact: Q4_0/Q4_1/Q4_K as 4-bit, Q5_0/Q5_1/Q5_K/Q6_K/Q8_0 as "
             "8-bit MatMulNBits, block minimums as their own matmul; F16/BF16 and other types as fp32")


def _cpu_precisions() -> tuple[PrecisionInfo, ...]:
    # MatMulNBits may take a one-row path that rounds apart from its multi-row
    # kernel (it does on AVX2 hosts): one-token calls then run padded to two
    # rows, decided per host by a bitwise check at load (row_check.py).
    checked = "one-token calls padded unless a check at load finds one row exact on this host"
    return (PrecisionInfo("fp32", True, _EXACT),
            PrecisionInfo("int8", True, f"weight-only MatMulNBits 8-bit; {checked}"),
            PrecisionInfo("int4", True, f"weight-only MatMulNBits 4-bit (LM head 8-bit); {checked}"),
            PrecisionInfo("gguf", True, f"{GGUF_NOTE}; {checked}"))


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


def session_options(threads: int):
    """Options of every session this backend opens. Its threads spin while a run is
    under way (waking them per op costs) but stop when the run returns: a draft
    and a target in one process run in turn, and a pool still spinning after its
    run took a core from the other's (measured on 2 cores: the 1.5B's verify
    1.27x slower beside a spinning SmolLM2 draft, the draft's steps too; one
    session alone decodes at the same speed either way)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    opts.add_session_config_entry("session.force_spinning_stop", "1")
    return opts


def export_onnx(model: ModelIR, precision: str, progress=None, batched: bool = False):
    """The model's ONNX file for this precision, built once and cached; the
    weights stream to an external file tensor by tensor (onnx_weights.py).
    batched: the graph for several sequences per call (onnx_batch.py)."""
    from importlib.metadata import version

    import onnxruntime as ort

    cfg = model.config
    extra = {"head": cfg.output_vocab} if cfg.output_vocab else {}
    if batched:
        extra["batched"] = 1
    if cfg.feature_layers:  # a graph with the extra output; the key without it is unchanged
        extra["features"] = list(cfg.feature_layers)
    folder = cache_dir("onnx", model, graph=GRAPH_VERSION, precision=precision,
                       onnx=version("onnx"), ort=ort.__version__, **extra)

    def build(path):
        if progress is not None:
            progress(0, 0, f"lowering to ONNX{' (batched graph)' if batched else ''}, {precision} weights "
                           "(once; cached)")
        build_llama_onnx(model, precision, path, progress, batched=batched)

    return cached(folder, "model.onnx", build)


def build_llama_onnx(*args, **kwargs):
    """The lowering (onnx_llama.py), imported only to build a graph: a cached one
    loads without onnx or torch."""
    from hetero_sd.backends.onnx_llama import build_llama_onnx as build

    return build(*args, **kwargs)


class OrtRunner(GraphRunner):
    """Every call, one sequence or several, runs the batched graph (onnx_batch.py):
    one session and one copy of the weights, and a row rounds alike alone or in
    any batch because it is the same graph (measured as fast as the one-sequence
    graph for one sequence)."""

    max_batch = 32  # sequences per call (a server's running set is split above it)
    can_copy_prefix = True  # every row is row-invariant: copied KV is what a prefill writes

    def __init__(self, model: ModelIR, info: DeviceInfo, precision: PrecisionInfo, kv_budget_bytes: int,
                 progress=None):
        super().__init__(model, info, precision, kv_budget_bytes,
                         pad_single_row=precision.name in ("int8", "int4", "gguf"))
        import onnxruntime as ort

        path = export_onnx(model, precision.name, progress, batched=True)
        self._session = self._open(path)
        self._outputs = [o.name for o in self._session.get_outputs()]
        self.settle_padding(path, f"onnxruntime {ort.__version__} {self.device.device}")

    def _open(self, path):
        import onnxruntime as ort

        opts = session_options(len(os.sched_getaffinity(0)))
        provider = next((p for p, d in _PROVIDERS.items() if self.device.device.startswith(d)),
                        "CPUExecutionProvider")
        return ort.InferenceSession(str(path), opts, providers=[provider])

    def forward(self, seq_id: int, tokens: Sequence[int], start: int, num_logits: int) -> np.ndarray:
        return self.forward_batch([BatchItem(seq_id, tokens, start, num_logits)])[0]

    def _infer_batch(self, feeds: dict) -> list:
        return self._session.run(self._outputs, feeds)

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Give the empty sequence `dst` the KV of `src`'s first `length` positions.
        Every row here is row-invariant (prefill included: tested), so the copy is
        bitwise the KV dst would compute for the same tokens: a server reuses a
        shared prompt prefix instead of computing it again."""
        if length > self.length(src):
            raise ValueError(f"sequence {src} holds {self.length(src)} positions, not {length}")
        if self.length(dst):
            raise ValueError(f"sequence {dst} is not empty")
        with self._alloc.writing(dst, 0, length):
            self._slabs[dst][:, :, :, :length] = self._slabs[src][:, :, :, :length]
