"""Optional capabilities are declared on the Runner and Drafter contracts, with
defaults, and every built-in declares or inherits each; nothing of ours is
found by probing (hasattr / getattr with a default / signature checks)."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from hetero_sd.backends.base import API_VERSION, API_VERSIONS, DeviceInfo, PrecisionInfo, RequiredOnly, Runner
from hetero_sd.drafting.base import Drafter

ROOT = Path(__file__).resolve().parents[2]

RUNNER_REQUIRED = {"allocate", "forward", "greedy", "truncate", "length", "release", "usage"}
RUNNER_OPTIONAL = {"max_batch": 1, "forward_batch": None, "feature_layers": (), "take_features": None,
                   "can_copy_prefix": False, "copy_prefix": None, "close": None, "location": None,
                   "kernel_choice": "", "pads_single_row": False,
                   "draft_only": None, "asynchronous": False, "submit": None}
DRAFTER_REQUIRED = {"begin", "draft", "reset"}
DRAFTER_OPTIONAL = {"can_fork": False, "fork": None, "takes_guide": True, "feature_layers": (), "runner": None,
                    "observe": None, "wait_ready": None, "close": None, "model_free": False, "one_hot": False,
                    "draft_device": "cpu", "predrafts": True}  # (two properties: their defaults for a bare drafter)


def _runner_classes():
    from hetero_sd.backends.cuda.runner import CudaRunner
    from hetero_sd.backends.openvino_backend import OpenVINORunner
    from hetero_sd.backends.ort_backend import OrtRunner
    from hetero_sd.backends.torch_runner import TorchRunner
    from hetero_sd.cluster.ray_target import RayRunner
    from hetero_sd.failover import FailoverRunner
    from hetero_sd.testing.fake_backend import FakeRunner

    return [TorchRunner, OrtRunner, OpenVINORunner, CudaRunner, FakeRunner, RayRunner, FailoverRunner, RequiredOnly]


def _drafter_classes():
    from hetero_sd.drafting.cascade import CascadeDrafter
    from hetero_sd.drafting.head import HeadDrafter
    from hetero_sd.drafting.hybrid import HybridDrafter
    from hetero_sd.drafting.model import ModelDrafter
    from hetero_sd.drafting.ngram import NgramDrafter
    from hetero_sd.drafting.remote import RemoteDrafter
    from hetero_sd.drafting.suffix import SuffixDrafter
    from hetero_sd.failover import FailoverDrafter

    return [NgramDrafter, SuffixDrafter, ModelDrafter, HeadDrafter, HybridDrafter, CascadeDrafter, RemoteDrafter,
            FailoverDrafter]


def _public(cls) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_")}


@pytest.mark.parametrize("base,required,optional", [(Runner, RUNNER_REQUIRED, RUNNER_OPTIONAL),
                                                    (Drafter, DRAFTER_REQUIRED, DRAFTER_OPTIONAL)])
def test_every_optional_capability_is_declared_with_its_default(base, required, optional):
    for name, default in optional.items():
        assert name in vars(base), f"{base.__name__}.{name} is not declared on the contract"
        value = vars(base)[name]
        assert name in inspect.getdoc(inspect.getmodule(base)), f"the contract's docstring omits {name}"
        if isinstance(value, property):  # computed from other declarations: read on a bare instance
            bare = type("Bare", (base,), {m: lambda *a, **k: None for m in base.__abstractmethods__})()
            assert getattr(bare, name) == default, f"{base.__name__}.{name} is {getattr(bare, name)!r}"
        elif default is None and callable(value):
            assert name not in getattr(base, "__abstractmethods__", ()), f"{name} must have a default"
        else:
            assert value == default, f"{base.__name__}.{name} defaults to {value!r}, not {default!r}"
    assert required <= set(base.__abstractmethods__)
    # a new method on the contract is either required or listed here as optional
    extra = _public(base) - required - set(optional) - {"name", "device", "precision", "vocab_size", "max_context",
                                                        "context", "context_for", "forget_context"}
    assert not extra, f"{base.__name__} has methods this test does not list: {sorted(extra)}"


@pytest.mark.parametrize("cls", _runner_classes(), ids=lambda c: c.__name__)
def test_each_built_in_runner_declares_or_inherits_every_capability(cls):
    assert issubclass(cls, Runner)
    for name in RUNNER_OPTIONAL:
        assert hasattr(cls, name), name  # (this test may probe: it checks the declarations)
    if cls.copy_prefix is not Runner.copy_prefix and isinstance(vars(Runner)["can_copy_prefix"], bool):
        declared = inspect.getattr_static(cls, "can_copy_prefix")
        assert declared is not False or "can_copy_prefix" in inspect.getsource(cls.__init__), \
            f"{cls.__name__} copies prefixes but does not say so"


@pytest.mark.parametrize("cls", _drafter_classes(), ids=lambda c: c.__name__)
def test_each_built_in_drafter_declares_or_inherits_every_capability(cls):
    assert issubclass(cls, Drafter)
    for name in DRAFTER_OPTIONAL:
        assert hasattr(cls, name), name
    overrides_fork = cls.fork is not Drafter.fork
    assert overrides_fork == cls.can_fork, f"{cls.__name__}: fork() and can_fork disagree"


_OURS = ("copy_prefix", "fork", "take_features", "feature_layers", "close", "observe", "max_batch",
         "forward_batch", "set_cost", "runner", "location", "wait_ready", "can_fork", "can_copy_prefix",
         "takes_guide", "partial", "release_pages", "blocks", "pads_single_row", "model_free", "one_hot",
         "draft_prices")
_PROBE = re.compile(r"""(hasattr|getattr)\([^()]*?["'](%s)["']""" % "|".join(_OURS))


def test_no_capability_of_ours_is_found_by_probing():
    """What the issue's grep shows, as a test: hasattr/getattr-with-default on one of
    our contracts' names, or a signature check, decides nothing in the packages."""
    found = []
    for folder in ("hetero_sd", "backends", "scheduler", "ir"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text()
            for m in _PROBE.finditer(text):
                found.append(f"{path.relative_to(ROOT)}: {m.group(0)}")
            if "inspect.signature(" in text:
                found.append(f"{path.relative_to(ROOT)}: inspect.signature")
    assert not found, found


def test_a_version_1_backends_runner_offers_the_required_methods_alone(tiny_model_dir):
    from hetero_sd.backends.registry import Registry, discover
    from hetero_sd.drafting.specs import ModelSpec
    from hetero_sd.errors import BackendError
    from hetero_sd.loading import Loader

    torch_backend = discover().get("torch")

    class Old:
        name, api_version = "old", 1

        def probe(self):
            return [DeviceInfo(self.name, "cpu", "old", (PrecisionInfo("fp32", True),), "fp32")]

        def load(self, model, device, precision, kv_budget_bytes, progress=None):
            inner = torch_backend.load(model, "cpu", "fp32", kv_budget_bytes)

            class V1:  # duck-typed, with a method v1 could only be probed for
                device, precision = inner.device, inner.precision
                vocab_size, max_context = inner.vocab_size, inner.max_context
                allocate, forward, greedy = inner.allocate, inner.forward, inner.greedy
                truncate, length, release, usage = inner.truncate, inner.length, inner.release, inner.usage

                def copy_prefix(self, *args):
                    raise AssertionError("a version 1 runner's undeclared method must not be used")

            return V1()

    class New(Old):
        name, api_version = "new", API_VERSION

    assert set(API_VERSIONS) == {1, 2} and API_VERSION == 2
    load = Loader(Registry({"old": Old(), "new": New()}))
    runner = load(ModelSpec(str(tiny_model_dir("llama")), "old", "cpu", "fp32", 1 << 20, "target"))
    assert isinstance(runner, RequiredOnly) and not runner.can_copy_prefix and runner.max_batch == 1
    seq = runner.allocate(8)
    assert len(runner.greedy(seq, [1, 2, 3], 0, 1)) == 1 and runner.length(seq) == 3
    with pytest.raises(BackendError, match="'new' returned a V1, which is not a hetero_sd.backends.base.Runner"):
        load(ModelSpec(str(tiny_model_dir("llama")), "new", "cpu", "fp32", 1 << 20, "target"))


def test_a_plugin_of_an_unknown_api_version_is_recorded_as_broken():
    from hetero_sd.backends.registry import Registry, _instantiate

    class Future:
        name, api_version = "future", API_VERSION + 1

        def probe(self):
            return []

        def load(self, *args, **kwargs):
            raise AssertionError

    registry = Registry()
    _instantiate("future", Future, registry)
    assert "future" not in registry.backends and "declares API version 3" in registry.broken["future"]
