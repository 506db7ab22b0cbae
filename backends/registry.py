"""Finding backends: built-ins and plugins from the `hetero_sd.backends`
entry-point group, each checked for API compatibility. A plugin that fails to
import, declares another API version, lacks the Backend methods or whose probe
raises is recorded as broken (with the reason and its package), never fatal.

A backend that is not installed as a package (one being written, or the fake
backend of hetero_sd.testing) is named in the environment instead, and reaches
worker processes the same way:

    HETERO_SD_BACKENDS="fake=hetero_sd.testing.fake_backend:FakeBackend,mine=my_pkg.backend:MyBackend"
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from importlib.metadata import entry_points

from hetero_sd.backends.base import API_VERSION, API_VERSIONS, Backend
from hetero_sd.ir.errors import BackendError

GROUP = "hetero_sd.backends"
ENV = "HETERO_SD_BACKENDS"  # comma-separated name=module:Class, loaded like plugins
BUILTINS = {"torch": "hetero_sd.backends.torch_backend:TorchBackend",
            "onnxruntime": "hetero_sd.backends.ort_backend:OrtBackend",
            "openvino": "hetero_sd.backends.openvino_backend:OpenVINOBackend",
            "cuda": "hetero_sd.backends.cuda.backend:CudaBackend"}


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


def load_builtin(name: str) -> Backend:
    """A fresh instance of the built-in backend `name` (a key of BUILTINS)."""
    return _load(BUILTINS[name])()


def _instantiate(name: str, factory, registry: Registry, origin: str = "", probe: bool = False) -> None:
    try:
        backend = factory()
        missing = [m for m in ("probe", "load") if not callable(getattr(backend, m, None))]
        if missing:
            raise BackendError(f"{type(backend).__name__} is not a backend: no {' or '.join(missing)} method")
        version = getattr(backend, "api_version", None)
        if version not in API_VERSIONS:
            raise BackendError(f"declares API version {version}, this hetero-sd speaks "
                               f"{' and '.join(map(str, API_VERSIONS))} (current: {API_VERSION})")
        if probe:  # third-party probes run once here, so a crashing one is caught before use
            try:
                list(backend.probe())
            except Exception as exc:
                raise BackendError(f"probe() raised {type(exc).__name__}: {exc}") from exc
        registry.backends[name] = backend
    except (Exception, SystemExit) as exc:  # a third-party plugin may fail in any way
        registry.broken[name] = f"{origin}{type(exc).__name__}: {exc}"


def _origin(ep) -> str:
    dist = getattr(ep, "dist", None)
    return f"[{dist.name} {dist.version}, {ep.value}] " if dist is not None else f"[{ep.value}] "


def discover() -> Registry:
    registry = Registry()
    found = {ep.name: ep for ep in entry_points(group=GROUP)}
    for name, spec in BUILTINS.items():
        if name not in found:  # running from a source tree without installed metadata
            _instantiate(name, lambda spec=spec: _load(spec)(), registry)
    for name, ep in found.items():
        builtin = BUILTINS.get(name) == ep.value
        _instantiate(name, lambda ep=ep: ep.load()(), registry,
                     origin="" if builtin else _origin(ep), probe=not builtin)
    for item in filter(None, (part.strip() for part in os.environ.get(ENV, "").split(","))):
        name, _, spec = item.partition("=")
        if not name or ":" not in spec:
            registry.broken[name or item] = f"[{ENV}] {item!r} is not name=module:Class"
            continue
        _instantiate(name.strip(), lambda spec=spec.strip(): _load(spec)(), registry,
                     origin=f"[{ENV}: {spec.strip()}] ", probe=True)
    return registry
