"""Loading runners: the one place a ModelSpec becomes a Runner.

    loader = Loader(progress=True)
    loader.check(spec)        # backend, device and precision exist here (probes only, loads nothing)
    runner = loader(spec)     # the model loaded on its placement, with a progress bar

A Loader reads each model file's IR once, so a target and a draft on the same
file share it. The engine's builder, placement: auto and worker processes all
load through it. Each spec's backend options (ModelSpec.options) go to its load;
without a registry given, backends are discovered per options (plugins included).
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from hetero_sd.backends.base import DeviceInfo, PrecisionInfo, RequiredOnly, Runner, resolve
from hetero_sd.backends.options import DEFAULT as DEFAULT_OPTIONS, BackendOptions
from hetero_sd.backends.registry import BUILTINS, Registry, discover, load_builtin, load_runner
from hetero_sd.drafting.specs import ModelSpec
from hetero_sd.errors import BackendError, describe
from hetero_sd.ir.model import ModelIR, load_model_ir


class Loader:
    def __init__(self, registry: Registry | None = None, progress: bool = False,
                 options: BackendOptions = DEFAULT_OPTIONS):
        self._registry, self.progress, self.options = registry, progress, options
        self._discovered: dict[BackendOptions, Registry] = {}
        self._irs: dict[Path, ModelIR] = {}
        self._tokenizers: dict[Path, object] = {}  # read once: a build asks for each several times

    @property
    def registry(self) -> Registry:
        return self.registry_for(self.options)

    def registry_for(self, options: BackendOptions) -> Registry:
        """The registry given, else backends discovered with `options` (once per options)."""
        if self._registry is not None:
            return self._registry
        if options not in self._discovered:
            self._discovered[options] = discover(options)
        return self._discovered[options]

    def backend(self, name: str, options: BackendOptions | None = None):
        options = self.options if options is None else options
        if self._registry is None and name in BUILTINS:  # a worker: import only the backend it needs
            try:
                return load_builtin(name, options)
            except Exception as exc:  # its runtime is missing or broken here
                raise BackendError(f"backend {name!r} cannot be used here: {describe(exc)}") from exc
        return self.registry_for(options).get(name)

    def ir(self, model: str | Path) -> ModelIR:
        path = Path(model).resolve()
        if path not in self._irs:
            self._irs[path] = load_model_ir(path)
        return self._irs[path]

    def tokenizer(self, model: str | Path):
        """The model's tokenizer (built once from a GGUF and cached, with a progress line)."""
        path = Path(model).resolve()
        if path not in self._tokenizers:
            with _progress(self.progress, f"tokenizer of {path.name}") as progress:
                self._tokenizers[path] = self.ir(path).load_tokenizer(progress=progress)
        return self._tokenizers[path]

    def shares_tokenizer(self, model: str | Path, target: str | Path) -> bool:
        """Whether the same id means the same text in both (equal sizes are not enough);
        a draft that does not drafts through the text (drafting/cross_vocab.py)."""
        if Path(model).resolve() == Path(target).resolve():
            return True
        return self.tokenizer(model).get_vocab() == self.tokenizer(target).get_vocab()

    def check(self, spec: ModelSpec) -> tuple[DeviceInfo, PrecisionInfo]:
        """Backend, device and precision exist here (cheap: probes only, loads nothing)."""
        try:
            return resolve(self.backend(spec.backend, spec.options).probe(), spec.backend, spec.device,
                           spec.precision)
        except BackendError as exc:
            raise BackendError(f"{spec.role}: {exc}") from None

    def __call__(self, spec: ModelSpec) -> Runner:
        info, precision = self.check(spec)
        with _progress(self.progress, f"loading {spec.role} on {spec.backend}:{info.device} {precision.name}"
                       ) as progress:
            model = self.ir(spec.model).with_output_vocab(spec.vocab).with_features(spec.features or None)
            backend = self.backend(spec.backend, spec.options)
            runner = _contract(backend, load_runner(backend, model, info.device, precision.name, spec.kv_budget,
                                                    progress, spec.options))
        if spec.features and tuple(runner.feature_layers) != tuple(spec.features):
            # a backend that ignores the model's feature layers (a plugin written before them)
            raise BackendError(f"{spec.role}: backend {spec.backend!r} cannot return hidden states "
                               f"(features of layers {list(spec.features)} were asked for; its runner has "
                               f"no take_features for them): run it on torch, onnxruntime or openvino")
        return runner


def _contract(backend, runner) -> Runner:
    """The runner under the contract its backend's API version promises: version 1
    runners offer the required methods alone (RequiredOnly); later ones subclass Runner."""
    if backend.api_version == 1:  # (a Registry built by hand skips the registry's version check)
        return runner if isinstance(runner, Runner) else RequiredOnly(runner)
    if not isinstance(runner, Runner):
        raise BackendError(f"backend {backend.name!r} returned a {type(runner).__name__}, which is not a "
                           "hetero_sd.backends.base.Runner (API version 2: runners subclass it)")
    return runner


class _Progress:
    """A progress(i, total, name) callback drawing a tqdm bar on first use (a
    step that never reports, like a cached load, draws nothing)."""

    def __init__(self, label: str):
        self.label, self.bar = label, None

    def __call__(self, i: int, total: int, name: str) -> None:
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(desc=self.label, unit="tensor", leave=False)
        if total:  # tensor i of total
            self.bar.total, self.bar.n = total, i + 1
            self.bar.set_postfix_str(name[-40:], refresh=False)
        else:  # a long step with no count: say what it is
            self.bar.set_postfix_str(name, refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@contextmanager
def _progress(enabled: bool, label: str):
    """A _Progress callback (None when progress is off), closed on the way out."""
    bar = _Progress(label) if enabled else None
    try:
        yield bar
    finally:
        if bar is not None:
            bar.close()
