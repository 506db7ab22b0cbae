"""Backend plugins, installed for real: the dummy plugin package
(plugins/hetero-sd-dummy) and a package of deliberately broken plugins
(plugins/hetero-sd-broken) are pip-installed once per session into a
temporary target folder. Then: discovery finds the dummy, `hetero-sd devices`
lists it, broken plugins are skipped with their reasons, and the dummy serves
as target and draft backend with output identical to target-only decoding."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib.metadata import distribution
from pathlib import Path

import numpy as np
import pytest

from hetero_sd.testing.fake_backend import ENV, PLUGIN
from hetero_sd.backends.options import BackendOptions
from hetero_sd.backends.registry import discover
from hetero_sd.config import load_config
from hetero_sd.drafting import ModelDrafter, NgramDrafter
from hetero_sd.engine import Engine
from hetero_sd.errors import BackendError
from hetero_sd.ir import load_model_ir, reference_logits
from helpers.tiny_models import random_prompt

PLUGINS = Path(__file__).resolve().parents[2] / "plugins"
BROKEN = {  # entry point -> what its reason must say
    "broken-import": "ModuleNotFoundError: No module named 'hetero_sd_vendor_runtime_that_is_not_installed'",
    "broken-version": "declares API version 3, this hetero-sd speaks 1 and 2",
    "broken-shape": "NotABackend is not a backend: no probe or load method",
    "broken-probe": "probe() raised OSError: driver not responding",
}


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory) -> Path:
    """pip-install both plugin packages (offline, no deps) into a fresh folder.
    The sources are copied first so the build leaves nothing in the repository."""
    root = tmp_path_factory.mktemp("plugins")
    sources = [shutil.copytree(PLUGINS / name, root / "src" / name)
               for name in ("hetero-sd-dummy", "hetero-sd-broken")]
    site = root / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
                           "--no-index", "--quiet", "--target", str(site), *map(str, sources)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"pip install failed:\n{proc.stdout}\n{proc.stderr}"
    return site


@pytest.fixture
def registry(plugin_site, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.syspath_prepend(str(plugin_site))
    return discover(BackendOptions(plugins=(PLUGIN,)))  # and the fake backend, named as a plugin


def test_not_found_before_install(monkeypatch):
    """Without the installed folder on the path there is no dummy: what the
    other tests find comes from the installation, not from the source tree."""
    monkeypatch.delenv(ENV, raising=False)
    registry = discover()
    assert "dummy" not in registry.backends and not set(BROKEN) & set(registry.broken)


def test_discover_finds_installed_dummy(registry, plugin_site):
    assert "dummy" in registry.backends and "dummy" not in registry.broken
    backend = registry.get("dummy")
    assert Path(sys.modules[type(backend).__module__].__file__).is_relative_to(plugin_site)
    assert distribution("hetero-sd-dummy").read_text("entry_points.txt").count("hetero_sd_dummy:DummyBackend")
    [info] = backend.probe()
    assert (info.backend, info.device, info.default_precision) == ("dummy", "dummy:0", "fp32")
    assert info.precision("fp32").batch_invariant
    for builtin in ("torch", "onnxruntime", "openvino", "fake"):
        assert builtin in registry.backends, registry.broken.get(builtin)


def test_broken_plugins_are_skipped_with_reasons(registry):
    for name, reason in BROKEN.items():
        assert name not in registry.backends
        why = registry.broken[name]
        assert why.startswith("[hetero-sd-broken 0.1.0, hetero_sd_broken") and reason in why, why
    with pytest.raises(BackendError, match="'broken-version' is installed but broken: .*API version 3"):
        registry.get("broken-version")
    assert registry.get("torch").probe()  # the host goes on


def _devices_cli(plugin_site, tmp_path, *args):
    exe = shutil.which("hetero-sd")
    assert exe is not None, "the `hetero-sd` console script is not on PATH (pip install -e .)"
    env = {k: v for k, v in os.environ.items() if k != ENV}
    env.update(PYTHONPATH=str(plugin_site), COLUMNS="250")
    return subprocess.run([exe, "devices", *args], capture_output=True, text=True, timeout=300,
                          env=env, cwd=tmp_path)


def test_devices_cli_lists_dummy_and_broken(plugin_site, tmp_path):
    proc = _devices_cli(plugin_site, tmp_path, "--json")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    data = json.loads(proc.stdout)
    dummy = [d for d in data["devices"] if d["backend"] == "dummy"]
    assert [d["device"] for d in dummy] == ["dummy:0"]
    assert any(d["backend"] == "torch" and d["device"] == "cpu" for d in data["devices"])
    assert not [d for d in data["devices"] if d["backend"] == "fake"]  # unconfigured: invisible
    for name, reason in BROKEN.items():
        assert reason in data["broken"][name]
    table = _devices_cli(plugin_site, tmp_path)
    assert table.returncode == 0 and "dummy:0" in table.stdout
    assert table.stdout.count("skipped:") == len(BROKEN)


# ------------------------------------------------------------------ the dummy as a backend
def _dummy(registry, folder, budget=1 << 20):
    return registry.get("dummy").load(load_model_ir(folder), "dummy:0", "default", budget)


def test_dummy_matches_reference_and_is_batch_invariant(registry, tiny_model_dir):
    folder = tiny_model_dir("qwen2")
    runner = _dummy(registry, folder)
    prompt = random_prompt(24, seed=3)
    seq = runner.allocate(64)
    np.testing.assert_allclose(runner.forward(seq, prompt, 0, len(prompt)),
                               reference_logits(load_model_ir(folder), prompt).numpy(), atol=1e-5, rtol=0)
    # Its declared batch invariance: a k-token verify equals k one-token steps, bitwise.
    runner.truncate(seq, 10)
    single = np.concatenate([runner.forward(seq, [t], 10 + i, 1) for i, t in enumerate(prompt[10:18])])
    runner.truncate(seq, 10)
    assert np.array_equal(runner.forward(seq, prompt[10:18], 10, 8), single)
    assert runner.length(seq) == 18 and runner.usage().filled_tokens == 18
    with pytest.raises(ValueError, match="leaves a gap"):  # a failed call keeps the length
        runner.forward(seq, [1, 2], 30, 2)
    assert runner.length(seq) == 18


def _assert_lossless(engine, prompt, max_new, label):
    spec = engine.generate_ids(prompt, max_new)
    base = engine.generate_ids(prompt, max_new, target_only=True)
    assert spec.token_ids == base.token_ids, f"{label}: speculative output diverges from target-only"
    assert spec.stats.lossless == "exact"
    return spec.stats


def test_dummy_as_target_with_ngram_drafter(registry, tiny_model_dir):
    target = _dummy(registry, tiny_model_dir("llama"))
    drafted = accepted = 0
    for k in (1, 3, 6):
        engine = Engine(target, NgramDrafter(1, 3), k=k)
        for seed in range(2):
            head = random_prompt(5 + 4 * seed, seed=seed + 10 * k)
            stats = _assert_lossless(engine, head * 2, 20, f"ngram k={k} seed={seed}")
            drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    assert accepted > 0 and drafted > accepted  # both accepted and rejected drafts were exercised


@pytest.mark.parametrize("pair", ["dummy/dummy", "torch/dummy", "dummy/torch"])  # target/draft
def test_dummy_as_target_and_draft_backend(registry, tiny_model_dir, pair):
    target_backend, draft_backend = pair.split("/")

    def load(backend, folder):
        if backend == "dummy":
            return _dummy(registry, folder)
        return registry.get(backend).load(load_model_ir(folder), "cpu", "fp32", 1 << 20)

    target = load(target_backend, tiny_model_dir("llama"))
    drafts = {"same model": load(draft_backend, tiny_model_dir("llama")),
              "other model": load(draft_backend, tiny_model_dir("llama", seed=1))}
    for name, draft in drafts.items():
        drafted = accepted = 0
        for k in (2, 5):
            engine = Engine(target, ModelDrafter(draft, target.vocab_size), k=k)
            for seed in range(2):
                stats = _assert_lossless(engine, random_prompt(4 + 7 * seed + k, seed=50 + k + seed), 16,
                                         f"{pair} {name} k={k} seed={seed}")
                drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
        assert drafted > 0
        if name == "same model":
            assert accepted / drafted > 0.5
        else:
            assert drafted > accepted


def test_dummy_from_yaml_config(registry, tiny_model_dir, tmp_path, monkeypatch):
    """The builder finds the plugin through discovery, as for any backend."""
    cls, loaded = type(registry.get("dummy")), []
    original = cls.load

    def counting_load(self, model, device, *args, **kwargs):
        loaded.append((model.source, device))
        return original(self, model, device, *args, **kwargs)

    monkeypatch.setattr(cls, "load", counting_load)
    path = tmp_path / "dummy.yaml"
    path.write_text(f"target: {{model: {tiny_model_dir('llama')}, backend: dummy, device: dummy:0}}\n"
                    f"drafter: {{kind: model, model: {tiny_model_dir('llama', seed=1)}, backend: dummy, "
                    "device: dummy, k: 4}\nmemory: {kv_budget: 1MiB}\n")
    engine = Engine.from_config(load_config(path))
    assert sorted(loaded) == sorted([(tiny_model_dir("llama"), "dummy:0"), (tiny_model_dir("llama", seed=1), "dummy:0")])
    prompt = random_prompt(12, seed=8)
    spec, base = engine.generate_ids(prompt, 24), engine.generate_ids(prompt, 24, target_only=True)
    assert spec.stats.mode == "model" and spec.stats.drafted > 0
    assert spec.token_ids == base.token_ids
