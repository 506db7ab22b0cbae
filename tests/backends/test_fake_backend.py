"""The fake backend: named devices with their own specs, real tokens from the
wrapped torch runner, the Runner contract, declared costs, injected failures
(firing exactly after N calls), and configuration through the backend options
(options.fake_backend, or HETERO_SD_FAKE_BACKEND read when a config loads), also
from a subprocess CLI run."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import numpy as np
import pytest
import torch

from hetero_sd.testing.fake_backend import (ENV, FakeBackend, FakeCosts, FakeDeviceSpec, FakeFailure,
                                             FakePrecisionSpec, PLUGIN, spec_from_text)
from hetero_sd.backends.options import BackendOptions
from hetero_sd.backends.registry import discover
from hetero_sd.backends.torch_backend import TorchBackend
from hetero_sd.cli import main
from hetero_sd.config import load_config
from hetero_sd.drafting import ModelDrafter, NgramDrafter
from hetero_sd.engine import Engine
from hetero_sd.errors import BackendError, ConfigError
from hetero_sd.ir import load_model_ir
from helpers.tiny_models import random_prompt

COSTS = FakeCosts(prefill_per_token_s=0.001, decode_per_token_s=0.02, verify_base_s=0.02,
                  verify_per_token_s=0.003, verify_table_s=(0.5, 0.6))


@pytest.fixture(autouse=True)
def _no_env_config(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)


def _fake(*devices, **kw):
    return FakeBackend(devices=list(devices), **kw)


def _load(backend, folder, device="fake:0", precision="default", budget=1 << 20):
    return backend.load(load_model_ir(folder), device, precision, budget)


# ------------------------------------------------------------------ devices and tokens
def test_named_devices_with_their_own_specs():
    backend = _fake(FakeDeviceSpec(), FakeDeviceSpec(description="slow one", default_precision="fp16",
                                                     precisions=("fp32", {"name": "fp16", "batch_invariant": False})))
    a, b = backend.probe()
    assert (a.device, b.device) == ("fake:0", "fake:1") and a.backend == b.backend == "fake"
    assert [p.name for p in a.precisions] == ["fp32"] and a.default_precision == "fp32"
    assert b.description == "slow one" and b.default_precision == "fp16"
    assert [(p.name, p.batch_invariant) for p in b.precisions] == [("fp32", True), ("fp16", False)]
    with pytest.raises(BackendError, match="no device 'fake:2'.*available: fake:0, fake:1"):
        backend.load(None, "fake:2", "default", 1 << 20)
    with pytest.raises(BackendError, match="does not support precision 'int4'"):
        backend.load(None, "fake:0", "int4", 1 << 20)


def test_tokens_and_logits_are_the_wrapped_runners(tiny_model_dir):
    folder = tiny_model_dir("llama")
    fake = _load(_fake(FakeDeviceSpec()), folder)
    real = TorchBackend().load(load_model_ir(folder), "cpu", "fp32", 1 << 20)
    prompt, drafts = random_prompt(20, seed=1), random_prompt(6, seed=2)
    for runner in (fake, real):
        runner.seq = runner.allocate(64)
    for method, args in (("forward", (prompt, 0, 1)), ("greedy", (drafts, 20, 6))):
        got = getattr(fake, method)(fake.seq, *args)
        want = getattr(real, method)(real.seq, *args)
        assert np.array_equal(got, want), method
    assert fake.vocab_size == real.vocab_size and fake.max_context == real.max_context
    assert fake.calls == 2


def test_runner_contract_truncate_is_o1_and_usage_delegates(tiny_model_dir):
    runner = _load(_fake(FakeDeviceSpec()), tiny_model_dir("llama"))
    seq = runner.allocate(64)
    runner.forward(seq, random_prompt(40, seed=5), 0, 1)
    k, v = runner.inner.kv_buffers()
    ptrs, k_before, v_before = (k.data_ptr(), v.data_ptr()), k.clone(), v.clone()
    runner.truncate(seq, 10)
    assert (k.data_ptr(), v.data_ptr()) == ptrs
    assert torch.equal(k, k_before) and torch.equal(v, v_before)  # not a byte moved
    assert runner.length(seq) == 10 and runner.calls == 1  # truncate is no runner call
    usage = runner.usage()
    assert usage == runner.inner.usage()
    assert (usage.sequences, usage.used_tokens, usage.filled_tokens) == (1, 64, 10)
    runner.release(seq)
    assert runner.usage().sequences == 0


def test_lossless_through_fake_devices(tiny_model_dir):
    """Draft on fake:0, target on fake:1: speculative ids equal target-only ids."""
    backend = _fake(FakeDeviceSpec(), FakeDeviceSpec())
    target = _load(backend, tiny_model_dir("llama"), "fake:1")
    draft = _load(backend, tiny_model_dir("llama", seed=1), "fake:0")
    drafted = 0
    for k in (1, 3, 6):
        for drafter in (ModelDrafter(draft, target.vocab_size), NgramDrafter(1, 3)):
            engine = Engine(target, drafter, k=k)
            prompt = random_prompt(8 + k, seed=k) * 2
            spec, base = engine.generate_ids(prompt, 20), engine.generate_ids(prompt, 20, target_only=True)
            assert spec.token_ids == base.token_ids, f"k={k} {drafter.name}"
            drafted += spec.stats.drafted
    assert drafted > 0 and draft.calls > 0


# ------------------------------------------------------------------ declared costs
def test_cost_curve():
    assert COSTS.prefill_s(10) == pytest.approx(0.01)
    assert COSTS.decode_s() == 0.02
    assert (COSTS.verify_s(1), COSTS.verify_s(2)) == (0.5, 0.6)  # the table
    assert COSTS.verify_s(5) == pytest.approx(0.02 + 5 * 0.003)  # linear beyond it
    assert COSTS.call_s(30, 1) == pytest.approx(0.03)  # a prompt
    assert COSTS.call_s(1, 1) == 0.02  # a decode step
    assert COSTS.call_s(4, 4) == COSTS.verify_s(4)
    with pytest.raises(ValueError):
        COSTS.verify_s(0)


def test_declared_costs_by_device_precision_and_model(tiny_model_dir):
    folder = tiny_model_dir("llama")
    fp16 = FakeCosts(decode_per_token_s=0.5)
    per_model = FakeCosts(decode_per_token_s=7.0)
    backend = _fake(FakeDeviceSpec(costs=COSTS),
                    FakeDeviceSpec(costs=FakeCosts(decode_per_token_s=1.0),
                                   precisions=("fp32", FakePrecisionSpec(name="fp16", costs=fp16)),
                                   model_costs={folder.name: per_model}))
    assert backend.declared_costs("fake:0") == COSTS
    assert backend.declared_costs("fake:1").decode_per_token_s == 1.0
    assert backend.declared_costs("fake:1", "fp16") == fp16
    assert backend.declared_costs("fake:1", "fp16", model="/elsewhere/other-model") == fp16
    assert backend.declared_costs("fake:1", "fp32", model=load_model_ir(folder)) == per_model
    assert _load(backend, folder, "fake:0").declared_costs() == COSTS
    assert _load(backend, folder, "fake:1").declared_costs() == per_model


def test_simulate_time_lasts_at_least_the_declared_cost(tiny_model_dir):
    costs = FakeCosts(prefill_per_token_s=0.01, decode_per_token_s=0.15)
    runner = _load(_fake(FakeDeviceSpec(costs=costs), simulate_time=True), tiny_model_dir("llama"))
    seq = runner.allocate(32)
    t0 = time.perf_counter()
    runner.greedy(seq, random_prompt(20, seed=1), 0, 1)  # prefill: 20 x 0.01 s
    t1 = time.perf_counter()
    runner.greedy(seq, [5], 20, 1)  # decode: 0.15 s
    t2 = time.perf_counter()
    assert t1 - t0 >= 0.2 and t2 - t1 >= 0.15
    unsimulated = _load(_fake(FakeDeviceSpec(costs=FakeCosts(decode_per_token_s=60.0))), tiny_model_dir("llama"))
    assert unsimulated.simulate_time is False


# ------------------------------------------------------------------ failures
@pytest.mark.parametrize("kind,error", [("backend_error", BackendError), ("runtime_error", RuntimeError)])
@pytest.mark.parametrize("after", [0, 1, 4])
def test_failure_fires_exactly_after_n_calls(tiny_model_dir, kind, error, after):
    failure = FakeFailure(after_calls=after, kind=kind, message="boom")
    runner = _load(_fake(FakeDeviceSpec(failure=failure)), tiny_model_dir("llama"))
    seq = runner.allocate(64)
    prompt = random_prompt(after + 2, seed=after)
    for i in range(after):
        runner.greedy(seq, prompt[i:i + 1], i, 1)
    assert runner.length(seq) == after and runner.failures == 0
    for _ in range(2):  # and every later call
        with pytest.raises(error, match="fake:0 call .*boom"):
            runner.greedy(seq, prompt[after:after + 1], after, 1)
    assert runner.length(seq) == after  # the failing call ran nothing
    assert (runner.calls, runner.failures) == (after + 2, 2)


def test_transient_failure_recovers(tiny_model_dir):
    runner = _load(_fake(FakeDeviceSpec(failure=FakeFailure(after_calls=1, times=2))), tiny_model_dir("llama"))
    seq = runner.allocate(16)
    runner.greedy(seq, [1, 2, 3], 0, 1)
    for _ in range(2):
        with pytest.raises(BackendError):
            runner.greedy(seq, [4], 3, 1)
    assert len(runner.greedy(seq, [4], 3, 1)) == 1 and runner.failures == 2


def test_hang_sleeps_then_raises(tiny_model_dir):
    runner = _load(_fake(FakeDeviceSpec(failure=FakeFailure(after_calls=1, kind="hang", hang_s=0.3))),
                   tiny_model_dir("llama"))
    seq = runner.allocate(16)
    runner.greedy(seq, [1, 2, 3], 0, 1)
    t0 = time.perf_counter()
    with pytest.raises(BackendError, match="hung for 0.3s"):
        runner.greedy(seq, [4], 3, 1)
    assert time.perf_counter() - t0 >= 0.3


def test_malformed_and_garbage_output(tiny_model_dir):
    folder = tiny_model_dir("llama")
    backend = _fake(FakeDeviceSpec(failure=FakeFailure(after_calls=0, kind="malformed")),
                    FakeDeviceSpec(failure=FakeFailure(after_calls=0, kind="garbage")))
    bad_shape, garbage = _load(backend, folder, "fake:0"), _load(backend, folder, "fake:1")
    for runner in (bad_shape, garbage):
        runner.seq = runner.allocate(32)
    prompt = random_prompt(6, seed=3)
    assert bad_shape.greedy(bad_shape.seq, prompt, 0, 1) == []
    assert bad_shape.forward(bad_shape.seq, [7, 8, 9], 6, 3).shape == (2, bad_shape.vocab_size)
    assert garbage.greedy(garbage.seq, prompt, 0, 3) == [garbage.vocab_size] * 3
    assert np.isnan(garbage.forward(garbage.seq, [7], 6, 1)).all()
    assert garbage.length(garbage.seq) == 7  # the wrapped call ran: only its output is bad


def test_load_failure_and_lost_device(tiny_model_dir):
    folder = tiny_model_dir("llama")
    backend = _fake(FakeDeviceSpec(),
                    FakeDeviceSpec(failure=FakeFailure(on_load=True, kind="runtime_error", message="no driver")),
                    FakeDeviceSpec(failure=FakeFailure(after_calls=1, device_lost=True)))
    with pytest.raises(RuntimeError, match="fake:1 load: no driver"):
        _load(backend, folder, "fake:1")
    lost = _load(backend, folder, "fake:2")
    seq = lost.allocate(16)
    lost.greedy(seq, [1, 2], 0, 1)
    assert [d.device for d in backend.probe()] == ["fake:0", "fake:1", "fake:2"]  # not fired yet
    with pytest.raises(BackendError):
        lost.greedy(seq, [3], 2, 1)
    assert [d.device for d in backend.probe()] == ["fake:0", "fake:1"]
    with pytest.raises(BackendError, match="fake:2 was lost.*available: fake:0, fake:1"):
        _load(backend, folder, "fake:2")


def test_bad_specs_are_refused():
    with pytest.raises(ValueError, match="on_load: true or after_calls"):
        FakeFailure()
    with pytest.raises(ValueError, match="output corruption"):
        FakeFailure(on_load=True, kind="garbage")
    with pytest.raises(ValueError, match="not one of"):
        FakeDeviceSpec(default_precision="int4")
    with pytest.raises(ValueError, match="unique"):
        FakeBackend(devices=[FakeDeviceSpec(device="fake:0"), FakeDeviceSpec(device="FAKE:0")])


def test_a_precision_may_not_claim_more_than_it_runs_as(tiny_model_dir):
    """Declaring batch invariance over a wrapped precision without it would fake
    losslessness; it is refused before anything loads."""
    liar = FakeDeviceSpec(inner_backend="openvino", inner_device="CPU",
                          precisions=({"name": "fp32", "runs_as": "ov-default"},))
    with pytest.raises(BackendError, match="claims batch invariance but runs as openvino:CPU ov-default"):
        _load(_fake(liar), tiny_model_dir("llama"))
    with pytest.raises(ConfigError, match="inner_backend 'fake' is not a built-in; allowed: torch"):
        _load(_fake(FakeDeviceSpec(inner_backend="fake")), tiny_model_dir("llama"))


# ------------------------------------------------------------------ configuration without code
def _from_config():
    """The backends a config loaded now sees (its options: the environment's switches)."""
    from hetero_sd.options import config_options

    return discover(config_options(load_config(None)))


def test_unconfigured_fake_sees_no_device(capsys):
    registry = discover(BackendOptions(plugins=(PLUGIN,)))
    assert registry.backends["fake"].probe() == [] and "fake" not in registry.broken
    assert main(["devices", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert not [d for d in data["devices"] if d["backend"] == "fake"] and "fake" not in data["broken"]


def test_env_json_and_yaml_file(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV, json.dumps({"devices": [{}, {"costs": {"decode_per_token_s": 0.5}}]}))
    backend = _from_config().get("fake")
    assert [d.device for d in backend.probe()] == ["fake:0", "fake:1"]
    assert backend.declared_costs("fake:1").decode_per_token_s == 0.5
    path = tmp_path / "fake.yaml"
    path.write_text("simulate_time: true\ndevices:\n  - device: fake:3\n"
                    "    failure: {after_calls: 2, kind: hang, hang_s: 1}\n")
    spec = spec_from_text(str(path))
    assert spec.simulate_time and spec.devices[0].device == "fake:3"
    assert spec.devices[0].failure.kind == "hang"
    assert spec_from_text("[{}]").devices[0].device == "fake:0"  # a bare list of devices
    full = FakeBackend(devices=[FakeDeviceSpec(costs=COSTS, failure=FakeFailure(after_calls=3),
                                               precisions=("fp32", FakePrecisionSpec(name="x", costs=COSTS)),
                                               model_costs={"m.gguf": COSTS})], simulate_time=True).spec
    assert spec_from_text(full.model_dump_json()) == full  # a spec built in code travels by env


@pytest.mark.parametrize("value,reason", [
    ('{"devices": [{"costs": {"decode_per_token_s": -1}}]}', "devices.0.costs.decode_per_token_s"),
    ('{"devices": [{"colour": "red"}]}', "devices.0.colour: Extra inputs"),
    ("{not json", "not valid JSON"),
    ("/no/such/file.yaml", "neither JSON nor the path"),
])
def test_bad_env_config_marks_fake_broken(monkeypatch, value, reason):
    monkeypatch.setenv(ENV, value)
    registry = _from_config()
    assert "fake" not in registry.backends and "torch" in registry.backends
    assert "ConfigError: options.fake_backend" in registry.broken["fake"] and reason in registry.broken["fake"]
    with pytest.raises(ConfigError):
        spec_from_text(value)


def _cli(config, env_value, tmp_path):
    exe = shutil.which("hetero-sd")
    assert exe is not None, "the `hetero-sd` console script is not on PATH (pip install -e .)"
    env = {k: v for k, v in os.environ.items() if k != ENV}
    env[ENV] = env_value
    return subprocess.run([exe, "generate", "--config", str(config), "--json", "--no-chat-template",
                           "--prompt", "the cat sat on the mat and the cat sat"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)


def test_cli_generate_on_fake_devices_from_env(tiny_model_dir, tmp_path):
    """A YAML config naming backend: fake works in a subprocess configured only by
    the environment, and its tokens are the wrapped torch runner's."""
    target, draft = tiny_model_dir("llama"), tiny_model_dir("llama", seed=1)
    spec = tmp_path / "fake.yaml"
    spec.write_text("devices:\n  - {device: fake:0}\n  - {device: fake:1, description: target card}\n")
    config = tmp_path / "cfg.yaml"
    body = ("target: {{model: {t}, backend: {b}, device: {d1}}}\n"
            "drafter: {{kind: model, model: {m}, backend: {b}, device: {d0}, k: 3}}\n"
            "generation: {{max_new_tokens: 12}}\nmemory: {{kv_budget: 1MiB}}\n")
    config.write_text(body.format(t=target, m=draft, b="fake", d0="fake:0", d1="fake:1"))
    proc = _cli(config, str(spec), tmp_path)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    torch_config = tmp_path / "torch.yaml"
    torch_config.write_text(body.format(t=target, m=draft, b="torch", d0="cpu", d1="cpu"))
    engine = Engine.from_config(load_config(torch_config))
    want = engine.generate("the cat sat on the mat and the cat sat", chat_template=False)
    assert got["token_ids"] == want.token_ids and len(want.token_ids) == 12
    assert got["stats"]["drafted"] > 0

    failing = json.dumps({"devices": [{}, {"failure": {"on_load": True, "message": "card fell off"}}]})
    proc = _cli(config, failing, tmp_path)
    assert proc.returncode == 2 and "card fell off" in proc.stderr and "Traceback" not in proc.stderr


def test_the_fake_backend_is_a_testing_utility_not_a_builtin(monkeypatch):
    """A plain install registers no fake backend; naming it in options.plugins (or
    HETERO_SD_BACKENDS, read when a config loads) does."""
    from importlib.metadata import entry_points

    assert "fake" not in {ep.name for ep in entry_points(group="hetero_sd.backends")}
    monkeypatch.delenv("HETERO_SD_BACKENDS", raising=False)
    for registry in (discover(), _from_config()):
        assert "fake" not in registry.backends and "fake" not in registry.broken and "torch" in registry.backends
    assert isinstance(discover(BackendOptions(plugins=(PLUGIN,))).backends["fake"], FakeBackend)
    monkeypatch.setenv("HETERO_SD_BACKENDS", PLUGIN)
    assert isinstance(_from_config().backends["fake"], FakeBackend)
    monkeypatch.setenv("HETERO_SD_BACKENDS", "fake=no_such_module:Nope, bad")
    broken = _from_config().broken
    assert "ModuleNotFoundError" in broken["fake"] and "not name=module:Class" in broken["bad"]
