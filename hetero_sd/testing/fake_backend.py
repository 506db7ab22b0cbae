"""The fake backend: declared devices, costs and failures around real tokens.

A testing utility, not a built-in: nothing registers it unless a test or a
plugin author does, in the backend options (so worker processes see it too:
their specs carry them) or in code:

    options: {plugins: ["fake=hetero_sd.testing.fake_backend:FakeBackend"]}   # PLUGIN below
    registry.backends["fake"] = FakeBackend(devices=[...])

It exists to test the splitter, the profiler and fault tolerance without
accelerators. Each fake device wraps a real runner (by default the torch
backend's CPU runner on the same model IR), so its tokens are the real
model's and lossless tests run through it. On top it
- declares costs (prefill per token, decode per token, a verify(T) curve) that
  that a test reads through `declared_costs` (to give the profiler figures
  that do not depend on this machine's load) and that `simulate_time` turns
  into sleeps;
- injects failures: on load, or after N runner calls an error, a hang, or
  malformed / garbage output;
- with `asynchronous: true`, runs calls on the device's own thread (submit returns
  at once, the declared cost passes there): a GPU's stream, for the overlap of
  drafting and verifying (scheduler/overlap.py) on a host without one.

Configure it in code, `FakeBackend(devices=[FakeDeviceSpec(device="fake:0")])`,
or with the backend options' `fake` (a config's `options.fake_backend`; for
subprocess and CLI tests $HETERO_SD_FAKE_BACKEND, read when the config loads)
holding JSON or the path of a YAML/JSON file:

    simulate_time: false
    devices:
      - device: fake:0
        costs: {prefill_per_token_s: 0.0005, decode_per_token_s: 0.004,
                verify_base_s: 0.004, verify_per_token_s: 0.0005}
      - device: fake:1
        precisions: [fp32, {name: fp16, batch_invariant: false}]
        failure: {after_calls: 5, kind: runtime_error}

Unconfigured it sees no device, so `hetero-sd devices` never shows it.
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Literal, Sequence

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hetero_sd.backends.base import (API_VERSION, DeviceInfo, DeviceQueue, Pending, PrecisionInfo, Runner, Wrapping,
                                      resolve)
from hetero_sd.backends.options import DEFAULT as DEFAULT_OPTIONS, BackendOptions
from hetero_sd.ir.errors import BackendError, ConfigError
from hetero_sd.ir.model import ModelIR

ENV = "HETERO_SD_FAKE_BACKEND"  # the devices (JSON, or a YAML/JSON file), read when a config loads
PLUGIN = "fake=hetero_sd.testing.fake_backend:FakeBackend"  # for BackendOptions.plugins


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FakeCosts(_Spec):
    """Declared seconds. A runner call of T tokens returning L logits costs
    prefill (L < T: a prompt), decode (T = 1) or verify(T) (T > 1, L = T)."""

    prefill_per_token_s: float = Field(0.0, ge=0)
    decode_per_token_s: float = Field(0.0, ge=0)
    verify_base_s: float = Field(0.0, ge=0)  # verify(T) = base + per_token * T ...
    verify_per_token_s: float = Field(0.0, ge=0)
    verify_table_s: tuple[float, ...] = ()  # ... unless T <= len(table): table[T-1]

    def prefill_s(self, tokens: int) -> float:
        return self.prefill_per_token_s * tokens

    def decode_s(self) -> float:
        return self.decode_per_token_s

    def verify_s(self, tokens: int) -> float:
        if tokens < 1:
            raise ValueError(f"verify needs at least one token, got {tokens}")
        if tokens <= len(self.verify_table_s):
            return self.verify_table_s[tokens - 1]
        return self.verify_base_s + self.verify_per_token_s * tokens

    def call_s(self, tokens: int, num_logits: int) -> float:
        """What one runner call costs, by the rule in the class docstring."""
        if num_logits < tokens:
            return self.prefill_s(tokens)
        return self.decode_s() if tokens == 1 else self.verify_s(tokens)


class FakePrecisionSpec(_Spec):
    name: str
    batch_invariant: bool = True  # must not claim more than the wrapped precision
    runs_as: str = "fp32"  # the wrapped runner's precision, which makes the tokens
    costs: FakeCosts | None = None  # None: the device's costs
    note: str = "fake precision"

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, data):
        return {"name": data} if isinstance(data, str) else data


class FakeFailure(_Spec):
    on_load: bool = False  # every load() fails (backend_error, runtime_error or hang)
    after_calls: int | None = Field(None, ge=0)  # the first N forward/greedy calls succeed
    kind: Literal["backend_error", "runtime_error", "hang", "malformed", "garbage"] = "backend_error"
    times: int | None = Field(None, ge=1)  # calls that fail, then it recovers; None: all later calls
    hang_s: float = Field(30.0, ge=0)  # kind=hang: sleep this long, then raise BackendError
    device_lost: bool = False  # once fired, the device leaves probe() and refuses loads
    message: str = "injected failure"

    @model_validator(mode="after")
    def _check(self):
        if not self.on_load and self.after_calls is None:
            raise ValueError("a failure needs on_load: true or after_calls: N")
        if self.on_load and self.kind in ("malformed", "garbage"):
            raise ValueError(f"kind {self.kind!r} is output corruption; on load use "
                             "backend_error, runtime_error or hang")
        return self


class FakeDeviceSpec(_Spec):
    device: str | None = None  # None: "fake:<index>"
    description: str = "fake device (declared costs, tokens from the wrapped runner)"
    precisions: tuple[FakePrecisionSpec, ...] = (FakePrecisionSpec(name="fp32"),)
    default_precision: str | None = None  # None: the first precision
    costs: FakeCosts = FakeCosts()
    model_costs: dict[str, FakeCosts] = {}  # by model file/folder name (or stem), over `costs`
    failure: FakeFailure | None = None
    # Calls run on the device's own thread: submit returns at once and the declared cost
    # (with simulate_time) passes there, as a GPU's stream would (Runner.asynchronous)
    asynchronous: bool = False
    inner_backend: str = "torch"  # a built-in backend that produces the tokens
    inner_device: str = "cpu"

    @model_validator(mode="after")
    def _check(self):
        names = [p.name for p in self.precisions]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"precisions must be non-empty and unique, got {names}")
        if self.default_precision is not None and self.default_precision not in names:
            raise ValueError(f"default_precision {self.default_precision!r} is not one of {names}")
        return self

    def precision(self, name: str) -> FakePrecisionSpec:
        return next(p for p in self.precisions if p.name == name)

    def costs_for(self, precision: str, model=None) -> FakeCosts:
        """Model-specific costs first, then the precision's, then the device's."""
        key = _model_key(model)
        if key is not None:
            for name, costs in self.model_costs.items():
                if name in key:
                    return costs
        return self.precision(precision).costs or self.costs


class FakeBackendSpec(_Spec):
    devices: tuple[FakeDeviceSpec, ...] = ()
    simulate_time: bool = False  # sleep so each call lasts at least its declared cost

    @model_validator(mode="before")
    @classmethod
    def _name_devices(cls, data):
        if isinstance(data, (list, tuple)):  # a bare list of devices
            data = {"devices": data}
        if isinstance(data, dict) and isinstance(data.get("devices"), (list, tuple)):
            named = []
            for i, dev in enumerate(data["devices"]):
                if isinstance(dev, FakeDeviceSpec) and dev.device is None:
                    dev = dev.model_copy(update={"device": f"fake:{i}"})
                elif isinstance(dev, dict) and dev.get("device") is None:
                    dev = {**dev, "device": f"fake:{i}"}
                named.append(dev)
            data = {**data, "devices": named}
        return data

    @model_validator(mode="after")
    def _unique(self):
        names = [d.device.lower() for d in self.devices]
        if len(set(names)) != len(names):
            raise ValueError(f"device names must be unique, got {names}")
        return self


def _model_key(model: ModelIR | str | Path | None) -> tuple[str, ...] | None:
    """The names a model is known by in `model_costs`: path, file/folder name, stem."""
    if model is None:
        return None
    path = Path(model.source if isinstance(model, ModelIR) else model)
    return (str(path), path.name, path.stem)


def spec_from_text(value: str = "", where: str = "options.fake_backend") -> FakeBackendSpec:
    """Read the fake backend's settings `value` (BackendOptions.fake): JSON, or a
    YAML/JSON file path; `where` names it in errors."""
    raw = value.strip()
    if not raw:
        return FakeBackendSpec()
    try:
        if raw[0] in "[{":
            data = json.loads(raw)
        else:
            path = Path(raw).expanduser()
            if not path.is_file():
                raise ConfigError(f"{where}={raw!r} is neither JSON nor the path of a YAML/JSON file")
            where = f"{where} file {path}"
            data = yaml.safe_load(path.read_text())
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"{where}: not valid JSON/YAML: {exc}") from None
    try:
        return FakeBackendSpec.model_validate(data or {})
    except ValidationError as exc:
        errors = "; ".join(f"{'.'.join(map(str, e['loc'])) or '<top level>'}: {e['msg']}"
                           for e in exc.errors())
        raise ConfigError(f"{where}: invalid fake backend spec: {errors}") from None


def _inject(failure: FakeFailure, where: str) -> None:
    """Raise as the failure declares (a hang sleeps first, then raises)."""
    message = f"{where}: {failure.message}"
    if failure.kind == "hang":
        time.sleep(failure.hang_s)
        raise BackendError(f"{message} (hung for {failure.hang_s}s)")
    if failure.kind == "runtime_error":
        raise RuntimeError(message)
    raise BackendError(message)


class FakeBackend:
    name = "fake"
    api_version = API_VERSION
    takes_options = True

    def __init__(self, devices: Sequence[FakeDeviceSpec | dict] | None = None,
                 simulate_time: bool | None = None, spec: FakeBackendSpec | None = None,
                 options: BackendOptions = DEFAULT_OPTIONS):
        """devices (or a whole spec) in code; neither: the settings options.fake holds."""
        self.options = options  # its inner runners' too
        if spec is None:
            spec = spec_from_text(options.fake) if devices is None else FakeBackendSpec(devices=tuple(devices))
        if simulate_time is not None:
            spec = spec.model_copy(update={"simulate_time": simulate_time})
        self.spec = spec
        self.lost: set[str] = set()  # devices whose failure declared them lost
        self._inner: dict[str, object] = {}

    def device_spec(self, device: str) -> FakeDeviceSpec:
        info, _ = resolve(self._all_devices(), self.name, device, "default")
        return next(d for d in self.spec.devices if d.device == info.device)

    def _all_devices(self) -> list[DeviceInfo]:
        return [DeviceInfo(self.name, d.device, d.description,
                           tuple(PrecisionInfo(p.name, p.batch_invariant, p.note) for p in d.precisions),
                           d.default_precision or d.precisions[0].name) for d in self.spec.devices]

    def probe(self) -> list[DeviceInfo]:
        return [d for d in self._all_devices() if d.device not in self.lost]

    def declared_costs(self, device: str, precision: str = "default", model=None) -> FakeCosts:
        """The costs this device declares for a precision (and model: a ModelIR or path)."""
        info, prec = resolve(self._all_devices(), self.name, device, precision)
        return self.device_spec(info.device).costs_for(prec.name, model)

    def load(self, model, device: str, precision: str, kv_budget_bytes: int, progress=None,
             options: BackendOptions | None = None) -> "FakeRunner":
        """options: its inner runner's (default: the backend's own)."""
        from hetero_sd.backends.registry import load_runner

        all_info, _ = resolve(self._all_devices(), self.name, device, "default")
        if all_info.device in self.lost:
            raise BackendError(f"{self.name}:{all_info.device} was lost after an injected failure; "
                               f"available: {', '.join(d.device for d in self.probe()) or 'none'}")
        info, prec = resolve(self.probe(), self.name, device, precision)
        spec = self.device_spec(info.device)
        failure = spec.failure
        if failure is not None and failure.on_load:
            self._fired(spec)
            _inject(failure, f"{self.name}:{info.device} load")
        pspec, inner_backend = spec.precision(prec.name), self._inner_backend(spec.inner_backend)
        _, inner_prec = resolve(inner_backend.probe(), spec.inner_backend, spec.inner_device, pspec.runs_as)
        if prec.batch_invariant and not inner_prec.batch_invariant:  # it would fake losslessness
            raise BackendError(f"{self.name}:{info.device} {prec.name} claims batch invariance but runs "
                               f"as {spec.inner_backend}:{spec.inner_device} {pspec.runs_as}, which has none")
        inner = load_runner(inner_backend, model, spec.inner_device, pspec.runs_as, kv_budget_bytes, progress,
                            options or self.options)
        return FakeRunner(inner, info, prec, spec.costs_for(prec.name, model), failure,
                          self.spec.simulate_time, lambda: self._fired(spec), spec.asynchronous)

    def _fired(self, spec: FakeDeviceSpec) -> None:
        if spec.failure is not None and spec.failure.device_lost:
            self.lost.add(spec.device)

    def _inner_backend(self, name: str):
        from hetero_sd.backends.registry import BUILTINS, load_builtin

        if name not in self._inner:
            if name == self.name or name not in BUILTINS:
                allowed = ", ".join(n for n in BUILTINS if n != self.name)
                raise ConfigError(f"fake device inner_backend {name!r} is not a built-in; allowed: {allowed}")
            self._inner[name] = load_builtin(name, self.options)
        return self._inner[name]


class FakeRunner(Wrapping):
    """A wrapped runner plus declared costs and injected failures. Pool methods
    (allocate, truncate, ...) delegate untouched, so truncate stays O(1); only
    forward/greedy are counted, timed and made to fail."""

    def __init__(self, inner: Runner, info: DeviceInfo, precision: PrecisionInfo, costs: FakeCosts,
                 failure: FakeFailure | None, simulate_time: bool, on_fire=None, asynchronous: bool = False):
        super().__init__(inner)
        self.device, self.precision = info, precision
        self.simulate_time = simulate_time
        self.calls = 0  # forward/greedy calls so far, failed ones included
        self.failures = 0  # calls that failed as injected
        self._costs, self._failure, self._on_fire = costs, failure, on_fire
        self._lock = threading.Lock()
        self.feature_layers = inner.feature_layers  # hidden states (backends/base.py): the wrapped runner's
        self.asynchronous = asynchronous
        # the device's queue: one thread runs submitted calls in order
        self._queue = DeviceQueue(f"fake-{info.device}") if asynchronous else None

    def take_features(self, seq_id: int):
        return self.inner.take_features(seq_id)

    @property
    def can_copy_prefix(self) -> bool:  # the wrapped runner's KV copy (uncosted: a memory copy)
        return self.inner.can_copy_prefix

    def copy_prefix(self, src_id: int, dst_id: int, length: int) -> bool:
        return self.inner.copy_prefix(src_id, dst_id, length)

    def declared_costs(self) -> FakeCosts:
        return self._costs

    def forward(self, seq_id: int, tokens: Sequence[int], start: int, num_logits: int) -> np.ndarray:
        return self._call("forward", seq_id, tokens, start, num_logits)

    def greedy(self, seq_id: int, tokens: Sequence[int], start: int, num_logits: int) -> list[int]:
        return self._call("greedy", seq_id, tokens, start, num_logits)

    def submit(self, seq_id: int, tokens: Sequence[int], start: int, num_logits: int,
               greedy: bool = True) -> Pending:
        if self._queue is None:
            return super().submit(seq_id, tokens, start, num_logits, greedy)
        method = "greedy" if greedy else "forward"
        return self._queue.submit(self._call, method, seq_id, list(tokens), start, num_logits)

    def _due(self) -> bool:
        """Count this call; is it one of the failing ones?"""
        with self._lock:
            self.calls += 1
            f = self._failure
            if f is None or f.after_calls is None or self.calls <= f.after_calls:
                return False
            due = f.times is None or self.calls - f.after_calls <= f.times
            self.failures += due
            return due

    def _call(self, method: str, seq_id: int, tokens: Sequence[int], start: int, num_logits: int):
        fail = self._due()
        if fail:
            if self._on_fire is not None:
                self._on_fire()
            if self._failure.kind not in ("malformed", "garbage"):
                # Raised before the wrapped call: the sequence keeps its length.
                _inject(self._failure, f"fake:{self.device.device} call {self.calls}")
        t0 = time.perf_counter()
        out = getattr(self.inner, method)(seq_id, tokens, start, num_logits)
        if self.simulate_time:
            time.sleep(max(0.0, self._costs.call_s(len(tokens), num_logits) - (time.perf_counter() - t0)))
        return self._corrupt(out) if fail else out

    def _corrupt(self, out):
        """malformed: one row fewer than asked; garbage: out-of-vocabulary ids, NaN logits."""
        if self._failure.kind == "malformed":
            return out[:-1]
        if isinstance(out, np.ndarray):
            return np.full_like(out, np.nan)
        return [self.vocab_size] * len(out)


def declared_figures(runner: FakeRunner, settings) -> dict:
    """What profiler.measure_runner measures (prefill, one-token step, verify
    widths), read from the runner's declared costs instead of a clock: a test
    whose outcome depends on the splitter's choice patches this in, so the
    choice does not depend on how loaded the machine is."""
    costs = runner.declared_costs()
    return {"prefill": [(n, costs.prefill_s(n)) for n in sorted(set(settings.prompt_lengths))],
            "decode_s": costs.decode_s(),
            "verify": [(w, costs.call_s(w, w)) for w in range(1, settings.k_max + 2)]}
