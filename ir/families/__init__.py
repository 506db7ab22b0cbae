"""Model families: one module each, found by HF model_type or GGUF architecture.

A family module provides HF_MODEL_TYPES, GGUF_ARCHS, config_from_hf,
config_from_gguf, weight_names, gguf_name_map, gguf_fixup, hf_aliases,
hf_fixup and a Forward class. What families share lives in decoder.py and
forward.py; what they differ in is a ModelConfig field (ir/config.py).
"""
from __future__ import annotations

from types import ModuleType

from hetero_sd.ir.errors import ModelLoadError
from hetero_sd.ir.families import gemma3, llama, mixtral, phi3, qwen3, qwen3_moe, smollm3

FAMILIES: dict[str, ModuleType] = {"llama": llama, "qwen3": qwen3, "qwen3_moe": qwen3_moe, "mixtral": mixtral,
                                   "gemma3": gemma3, "phi3": phi3, "smollm3": smollm3}


def _lookup(attr: str, key: str, what: str) -> ModuleType:
    for module in FAMILIES.values():
        if key in getattr(module, attr):
            return module
    known = sorted(k for m in FAMILIES.values() for k in getattr(m, attr))
    raise ModelLoadError(f"unsupported {what} {key!r}; supported: {', '.join(known)}")


def family_for_hf(model_type: str) -> ModuleType:
    return _lookup("HF_MODEL_TYPES", model_type, "model_type")


def family_for_gguf(arch: str) -> ModuleType:
    return _lookup("GGUF_ARCHS", arch, "GGUF architecture")


def family(name: str) -> ModuleType:
    return FAMILIES[name]


def supported() -> list[dict]:
    """What loads, family by family: its HF model_types, GGUF architectures and
    what it adds to the Llama decoder (the module's first docstring line)."""
    rows = []
    for name, module in FAMILIES.items():
        gguf = list(module.GGUF_ARCHS) or (["llama (with experts)"] if name == "mixtral" else [])
        rows.append({"family": name, "hf_model_types": list(module.HF_MODEL_TYPES), "gguf_archs": gguf,
                     "what": (module.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")})
    return rows
