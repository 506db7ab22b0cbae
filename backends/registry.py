"""Finding backends: built-ins and plugins from the `hetero_sd.backends`
entry-point group, each checked for API compatibility. A plugin that fails to
import or declares another API version is recorded as broken, never fatal."""
from __future__ import annotations

from dataclasses import dataclass, field
from importlib.metadata import entry_points

from hetero_sd.backends.base import API_VERSION, Backend
from hetero_sd.ir.errors import BackendError

GROUP = "hetero_sd.backends"
BUILTINS = {"torch": "hetero_sd.backends.torch_backend:TorchBackend",
            "onnxruntime": "hetero_sd.backends.ort_backend:OrtBackend",
            "openvino": "hetero_sd.backends.openvino_backend:OpenVINOBackend"}


@dataclass
class Registry:
    backends: dict[str, Backend] = field(default_factory=dict)
    broken: dict[str, str] = field(default_factory=dict)  # name -> why it was skipped

    def get(self, name: str) -> Backend:
        if name in self.backends:
            return self.backends[name]
        why = f" (plugin {name!r} is installed but broken: {self.broken[name]})" if name in self.broken else ""
        raise BackendError(f"unknown backend {name!r}{why}; available: {', '.join(sorted(self.backends))}")


def _load(spec: str):
    module, _, attr = spec.partition(":")
    obj = __import__(module, fromlist=[attr])
    return getattr(obj, attr)


def _instantiate(name: str, factory, registry: Registry) -> None:
    try:
        backend = factory()
        version = getattr(backend, "api_version", None)
        if version != API_VERSION:
            raise BackendError(f"declares API version {version}, this hetero-sd speaks {API_VERSION}")
        registry.backends[name] = backend
    except Exception as exc:  # a third-party plugin may fail in any way
        registry.broken[name] = f"{type(exc).__name__}: {exc}"


def discover() -> Registry:
    registry = Registry()
    found = {ep.name: ep for ep in entry_points(group=GROUP)}
    for name, spec in BUILTINS.items():
        if name not in found:  # running from a source tree without installed metadata
            _instantiate(name, lambda spec=spec: _load(spec)(), registry)
    for name, ep in found.items():
        _instantiate(name, lambda ep=ep: ep.load()(), registry)
    return registry
