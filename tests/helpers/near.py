"""A cheaper copy of a model, for drafting with the target's own weights.

bf16 on the torch backend where this CPU has bf16 matmuls, else int8 weights
on onnxruntime (hosts of this kind differ: some have AVX-512 BF16, some only
AVX2). Either rounds differently from the fp32 target, so a copy drafts well
but not perfectly: some drafts are rejected, as with a real draft model.
"""
from __future__ import annotations

from hetero_sd.backends.registry import load_builtin
from hetero_sd.backends.torch_backend import TorchBackend
from hetero_sd.drafting.specs import ModelSpec
from hetero_sd.ir import load_model_ir

_TORCH = {p.name for p in TorchBackend().probe()[0].precisions}
BACKEND, PRECISION = ("torch", "bf16") if "bf16" in _TORCH else ("onnxruntime", "int8")
YAML = f"backend: {BACKEND}, precision: {PRECISION}"  # for a config section


def load_near(path, budget: int = 4 << 20):
    return load_builtin(BACKEND).load(load_model_ir(path), "cpu", PRECISION, budget)


def near_spec(path, budget: int = 4 << 20) -> ModelSpec:
    return ModelSpec(str(path), BACKEND, "cpu", PRECISION, budget)
