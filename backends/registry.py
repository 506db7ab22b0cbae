"""Finding backends: built-ins and plugins from the `hetero_sd.backends`
entry-point group, each checked for API compatibility. A plugin that fails to
import, declares another API version, lacks the Backend methods or whose probe
raises is recorded as broken (with the reason and its package), never fatal.

A backend that is not installed as a package (one being written, or the fake
backend of hetero_sd.testing) is named in the backend options instead
(BackendOptions.plugins; a config's `options.plugins`, or $HETERO_SD_BACKENDS read
when the config loads), and reaches worker processes with its spec:

    options: {plugins: ["fake=hetero_sd.testing.fake_backend:FakeBackend", "mine=my_pkg.backend:MyBackend"]}

A backend class that declares `takes_options = True` (backends/base.py) is
constructed with the registry's BackendOptions, and `load_runner` passes a load's
own to its `load`; one that does not (a plugin written before them) gets neither.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from importlib.metadata import entry_points

from hetero_sd.backends.base import API_VERSION, API_VERSIONS, Backend
from hetero_sd.backends.options import DEFAULT as DEFAULT_OPTIONS, BackendOptions
from hetero_sd.ir.errors import BackendError

GROUP = "hetero_sd.backends"
PLUGINS_KEY = "options.plugins"  # how a broken entry of BackendOptions.plugins is named
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


def takes_options(backend) -> bool:
    """Its declaration (Backend.takes_options, backends/base.py): False where a backend
    (a plugin written before the options) declares nothing, as for api_version."""
    return getattr(backend, "takes_options", False) is True


def _construct(cls, options: BackendOptions):
    """An instance of a backend class, given `options` where it declares it takes them."""
    return cls(options=options) if takes_options(cls) else cls()


def load_runner(backend, model, device: str, precision: str, kv_budget_bytes: int, progress=None,
                options: BackendOptions = DEFAULT_OPTIONS):
    """backend.load, with `options` where the backend declares it takes them."""
    extra = {"options": options} if takes_options(backend) else {}
    return backend.load(model, device, precision, kv_budget_bytes, progress=progress, **extra)


def load_builtin(name: str, options: BackendOptions = DEFAULT_OPTIONS) -> Backend:
    """A fresh instance of the built-in backend `name` (a key of BUILTINS)."""
    return _construct(_load(BUILTINS[name]), options)


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


def discover(options: BackendOptions = DEFAULT_OPTIONS) -> Registry:
    """Every backend here, built-ins and installed plugins, and those options.plugins
    names; each constructed with `options` where it takes them."""
    registry = Registry()
    found = {ep.name: ep for ep in entry_points(group=GROUP)}
    for name, spec in BUILTINS.items():
        if name not in found:  # running from a source tree without installed metadata
            _instantiate(name, lambda spec=spec: _construct(_load(spec), options), registry)
    for name, ep in found.items():
        builtin = BUILTINS.get(name) == ep.value
        _instantiate(name, lambda ep=ep: _construct(ep.load(), options), registry,
                     origin="" if builtin else _origin(ep), probe=not builtin)
    for item in filter(None, (part.strip() for part in options.plugins)):
        name, _, spec = item.partition("=")
        if not name or ":" not in spec:
            registry.broken[name or item] = f"[{PLUGINS_KEY}] {item!r} is not name=module:Class"
            continue
        _instantiate(name.strip(), lambda spec=spec.strip(): _construct(_load(spec), options), registry,
                     origin=f"[{PLUGINS_KEY}: {spec.strip()}] ", probe=True)
    return registry
