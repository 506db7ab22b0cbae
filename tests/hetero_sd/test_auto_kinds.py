"""placement: auto builds every drafter kind it plans: a head, a hybrid (over a head or a
draft model), a cascade (stages pinned by the YAML or placed by the splitter) and a
worker (its keys kept from the YAML, its draft placed by the splitter); drafter.kind:
auto picks any of them. Each engine's greedy output equals target-only, and its plan
names the kind.

Fake devices declare their costs (profiler.measure_runner reads them: no clock), so
the choices do not depend on this machine's load; they wrap the torch CPU runner, so
the tokens are the tiny model's. The head is untrained: output equality holds for any
head (the target decides every token); only its acceptance would differ.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from hetero_sd.config import load_config
from hetero_sd.engine import Engine
from hetero_sd.errors import ConfigError
from helpers.tiny_models import random_prompt

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GPU, CPU = "fake:ga", "fake:ca"  # names of their own: profiles are cached per device
# GPU-like: asynchronous, a verify of w tokens 20 ms + 5 ms a token; CPU-like: ten times slower
DEVICES = {"simulate_time": False, "devices": [
    {"device": GPU, "asynchronous": True,
     "costs": {"prefill_per_token_s": 1e-5, "decode_per_token_s": 0.02, "verify_base_s": 0.02,
               "verify_per_token_s": 5e-3}},
    {"device": CPU, "costs": {"prefill_per_token_s": 1e-4, "decode_per_token_s": 0.2, "verify_base_s": 0.2,
                              "verify_per_token_s": 5e-2}}]}
PROMPTS = [random_prompt(12, seed=3), random_prompt(6, seed=4) * 2]
NEW = 20


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    """Declared costs, one profile cache for the module (every test plans on the same devices)."""
    from hetero_sd import profiler
    from hetero_sd.testing.fake_backend import ENV, declared_figures

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HETERO_SD_CACHE", str(tmp_path_factory.mktemp("cache")))
        mp.setattr(profiler, "measure_runner", declared_figures)
        mp.setenv(ENV, json.dumps(DEVICES))
        yield


@pytest.fixture(scope="module")
def models(tiny_model_dir, tmp_path_factory):
    """The target, a draft model, and an untrained EAGLE-3 head for the target."""
    from hetero_sd.ir import load_model_ir
    from hetero_sd.ir.eagle import HeadConfig
    from hetero_sd.training.head import init_head

    target = tiny_model_dir("llama")
    head = tmp_path_factory.mktemp("head") / "head"
    ir = load_model_ir(target)
    init_head(HeadConfig.for_target(ir.config, 160), ir, np.arange(160), seed=0).save(head)
    return {"target": target, "draft": tiny_model_dir("llama", seed=1), "head": head}


@pytest.fixture(scope="module")
def reference(models, fake, tmp_path_factory):
    """Target-only greedy output (the fake devices run the same torch fp32 runner)."""
    path = tmp_path_factory.mktemp("ref") / "ref.yaml"
    path.write_text(f"target: {{model: {models['target']}, backend: torch, precision: fp32}}\n"
                    f"drafter: {{kind: none}}\ngeneration: {{max_new_tokens: {NEW}, chat_template: false}}\n")
    engine = Engine.from_config(load_config(path), target_only=True)
    return [engine.generate_ids(p).token_ids for p in PROMPTS]


def _config(tmp_path, drafter: str, acceptance: str = "{model: 0.9}") -> str:
    path = tmp_path / "auto.yaml"
    path.write_text(f"placement: auto\ntarget: {{model: TARGET}}\ndrafter: {drafter}\n"
                    f"generation: {{max_new_tokens: {NEW}, chat_template: false}}\nmemory: {{kv_budget: 1MiB}}\n"
                    f"auto: {{quick: true, backends: [fake], precisions: [fp32], acceptance: {acceptance}}}\n")
    return str(path)


def _fill(path: str, words: dict) -> None:
    """Replace words in the config: TARGET, DRAFT and HEAD for `models`' paths (keys in capitals)."""
    with open(path) as f:
        text = f.read()
    for word, value in words.items():
        text = text.replace(word.upper() if word in ("target", "draft", "head") else word, str(value))
    with open(path, "w") as f:
        f.write(text)


def _plan(path: str):
    """plan_engine's (spec, policy, fallback, plan) for a config, with its backends (the fake one)."""
    from hetero_sd.auto import plan_engine
    from hetero_sd.backends.registry import discover
    from hetero_sd.loading import Loader
    from hetero_sd.options import config_options

    cfg = load_config(path)
    options = config_options(cfg)
    return plan_engine(cfg, Loader(discover(options), options=options))


def _run(path: str, models: dict, reference) -> tuple[Engine, str]:
    """The engine placement: auto builds and its drafter's class as built (a re-plan on the
    untrained head's low acceptance may swap it mid-run); its greedy output checked
    against target-only."""
    _fill(path, models)
    engine = Engine.from_config(load_config(path))
    built = type(engine.drafter).__name__
    try:
        assert [engine.generate_ids(p).token_ids for p in PROMPTS] == reference
    except BaseException:
        engine.close()
        raise
    return engine, built


@pytest.mark.parametrize("drafter, kind, via, cls", [
    ("{kind: head, head: HEAD}", "head", "", "HeadDrafter"),
    ("{kind: hybrid, head: HEAD}", "hybrid", "head", "HybridDrafter"),
    ("{kind: hybrid, hybrid_with: model, model: DRAFT}", "hybrid", "model", "HybridDrafter"),
])
def test_heads_and_hybrids_run_where_the_plan_puts_them(drafter, kind, via, cls, models, fake, reference, tmp_path):
    engine, built = _run(_config(tmp_path, drafter), models, reference)
    best = engine.plan.best
    assert best.drafter == kind and best.option.via == via and built == cls
    if kind == "head" or via == "head":  # on its target's placement, the target returning its features
        assert best.draft_placement == best.target and engine.target.feature_layers
    engine.close()


@pytest.mark.parametrize("drafter, stage_device", [
    ("{kind: model, model: DRAFT, stages: [{model: DRAFT}]}", None),  # the splitter places the stage
    (f"{{kind: ngram, stages: [{{model: DRAFT, device: {CPU}}}]}}", CPU),  # the YAML pins it
])
def test_a_cascade_runs_with_its_stages_placed(drafter, stage_device, models, fake, reference, tmp_path):
    engine, built = _run(_config(tmp_path, drafter), models, reference)
    best = engine.plan.best
    assert best.drafter == "cascade" and built == "CascadeDrafter"
    inner = "ngram" if stage_device else "model"
    assert best.option.inner.kind == inner and best.drafter_label.startswith(f"cascade({inner}")
    if stage_device:
        assert best.draft_placement.device == stage_device
    engine.close()


def test_a_worker_keeps_its_keys_and_takes_the_planned_placement(models, fake, reference, tmp_path):
    from hetero_sd.drafting.specs import WorkerSpec

    path = _config(tmp_path, "{kind: model, model: DRAFT, process: worker, threads: 1, timeout_s: 30}")
    engine, built = _run(path, models, reference)
    try:
        best = engine.plan.best
        assert best.drafter == "model" and best.process == "worker"
        assert built == "RemoteDrafter"
    finally:
        engine.close()
    spec = _plan(path)[0].drafter
    assert isinstance(spec, WorkerSpec) and (spec.transport, spec.threads, spec.timeout_s) == ("shm", 1, 30.0)
    assert (spec.inner.backend, spec.inner.device) == ("fake", best.draft_placement.device)


def test_kind_auto_picks_the_head_when_priors_and_costs_favour_it(models, fake, reference, tmp_path):
    """With k fixed, a head accepted at 0.95 beats lookups at 0.01 and a draft model at 0.05."""
    priors = "{head: 0.95, hybrid: 0.05, model: 0.05, ngram: 0.01, suffix: 0.01}"
    engine, built = _run(_config(tmp_path, "{kind: auto, k: 5, head: HEAD}", priors), models, reference)
    assert engine.plan.best.drafter == "head" and built == "HeadDrafter"
    assert {c.drafter for c in engine.plan.ranked} >= {"ngram", "suffix", "model", "head", "hybrid"}
    engine.close()


def test_a_head_that_is_not_there_is_said_clearly(models, fake, tmp_path):
    """kind: head with no trained head: the ConfigError names drafter.head and the file;
    kind: auto plans without it and explains why."""
    path = _config(tmp_path, "{kind: head}")
    _fill(path, models)
    with pytest.raises(ConfigError, match=r"auto.yaml: drafter.head: auto, but no head has been trained"):
        _plan(path)
    _fill(path, {"{kind: head}": "{kind: auto}"})
    _, _, _, plan = _plan(path)
    assert "not planned: head (no trained head:" in plan.explain()
    assert "head" not in {c.drafter for c in plan.ranked}


@pytest.mark.parametrize("drafter, words", [
    ("{kind: head, process: worker}", ["drafter.process", "a head reads the target's hidden states"]),
    ("{kind: hybrid, stages: [{model: TARGET}]}", ["drafter.stages", "got kind 'hybrid'"]),
    ("{kind: model, process: ray}", ["drafter.process: ray needs placement: manual"]),
])
def test_combinations_that_still_cannot_work_name_the_key(drafter, words, tmp_path):
    path = _config(tmp_path, drafter)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(path) in str(err.value) and all(w in str(err.value) for w in words)
