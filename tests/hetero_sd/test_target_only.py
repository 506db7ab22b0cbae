"""--target-only builds the target alone: no draft model is resolved, profiled or
loaded and no worker starts, whatever the drafter section says."""
from __future__ import annotations

import json

import pytest

from hetero_sd import auto, build, profiler
from hetero_sd.cli import main
from hetero_sd.config import load_config
from hetero_sd.engine import Engine
from hetero_sd.errors import ModelLoadError
from hetero_sd.loading import Loader
from hetero_sd.testing.fake_backend import ENV, declared_figures

PROMPT = [5, 9, 13, 5, 9, 13, 5, 9]


@pytest.fixture
def spy(monkeypatch):
    """What got built: the roles the Loader loaded, and every build_drafter call."""
    seen = {"loaded": [], "drafters": []}
    load, make = Loader.__call__, build.build_drafter
    monkeypatch.setattr(Loader, "__call__", lambda self, spec: seen["loaded"].append(spec.role) or load(self, spec))
    monkeypatch.setattr(build, "build_drafter",
                        lambda spec, *a, **k: seen["drafters"].append(spec) or make(spec, *a, **k))
    return seen


def _yaml(tmp_path, target, drafter: str, extra: str = "") -> str:
    path = tmp_path / "cfg.yaml"
    path.write_text(f"target: {{model: {target}}}\ndrafter: {{{drafter}}}\n"
                    f"generation: {{max_new_tokens: 8}}\nmemory: {{kv_budget: 1MiB}}\n{extra}")
    return str(path)


def test_target_only_loads_no_draft_model(tiny_model_dir, tmp_path, spy):
    cfg = _yaml(tmp_path, tiny_model_dir("llama"), f"kind: model, model: {tiny_model_dir('llama', seed=1)}, k: 3")
    full = Engine.from_config(cfg)
    assert sorted(spy["loaded"]) == ["draft model", "target"] and len(spy["drafters"]) == 1  # the contrast
    spy["loaded"].clear(), spy["drafters"].clear()
    alone = Engine.from_config(cfg, target_only=True)
    assert spy["loaded"] == ["target"] and spy["drafters"] == []
    assert alone.drafter is None
    result = alone.generate_ids(PROMPT)
    assert result.stats.mode == "target-only"
    assert result.token_ids == full.generate_ids(PROMPT, target_only=True).token_ids


def test_target_only_ignores_a_broken_drafter(tiny_model_dir, tmp_path):
    """A draft model that does not exist stops a speculative build, not a target-only one."""
    cfg = _yaml(tmp_path, tiny_model_dir("llama"), f"kind: model, model: {tmp_path / 'no-draft'}, backend: nope")
    with pytest.raises(Exception, match="nope|does not exist"):
        Engine.from_config(cfg)
    engine = Engine.from_config(cfg, target_only=True)
    assert engine.drafter is None and engine.generate_ids(PROMPT).token_ids


def test_target_only_starts_no_worker(tiny_model_dir, tmp_path, spy):
    cfg = _yaml(tmp_path, tiny_model_dir("llama"),
                f"kind: model, model: {tiny_model_dir('llama', seed=1)}, process: worker, transport: pipe")
    engine = Engine.from_config(cfg, target_only=True)
    assert spy["drafters"] == [] and spy["loaded"] == ["target"] and engine.drafter is None


def test_cli_target_only_with_a_missing_draft_model(tiny_model_dir, tmp_path, capsys):
    cfg = _yaml(tmp_path, tiny_model_dir("llama"), f"kind: model, model: {tmp_path / 'no-draft'}")
    args = ["generate", "--config", cfg, "--prompt", "hello", "--no-chat-template", "--json"]
    assert main(args) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(args + ["--target-only"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stats"]["mode"] == "target-only" and out["token_ids"]


def test_cli_target_only_skips_an_unknown_draft_name(tiny_model_dir, tmp_path, capsys):
    """A catalog name for the drafter is not even resolved (no join, no package check)."""
    cfg = _yaml(tmp_path, tiny_model_dir("llama"), "kind: model, model: not-a-catalog-name")
    args = ["generate", "--config", cfg, "--prompt", "hello", "--no-chat-template", "--json"]
    assert main(args) == 2
    assert "not-a-catalog-name" in capsys.readouterr().err
    assert main(args + ["--target-only"]) == 0


def test_auto_placement_target_only_profiles_no_draft(tiny_model_dir, tmp_path, monkeypatch, spy):
    monkeypatch.setattr(profiler, "measure_runner", declared_figures)  # declared costs, no clock
    monkeypatch.setenv(ENV, json.dumps({"simulate_time": False, "devices": [
        {"device": "fake:0", "costs": {"decode_per_token_s": 0.004, "verify_base_s": 0.004,
                                       "prefill_per_token_s": 1e-5}}]}))
    planned = []
    real = auto.auto_plan
    monkeypatch.setattr(auto, "auto_plan", lambda target, draft, **kw: planned.append((draft, kw["constraints"]))
                        or real(target, draft, **kw))
    draft = tiny_model_dir("llama", seed=1)
    cfg = load_config(_yaml(tmp_path, tiny_model_dir("llama"), f"kind: model, model: {draft}, k: 3",
                            "placement: auto\nauto: {quick: true, backends: [fake], precisions: [fp32]}\n"))
    full = Engine.from_config(cfg)
    assert planned[0][0] == str(draft) and full.drafter is not None and "draft model" in spy["loaded"]
    planned.clear(), spy["loaded"].clear(), spy["drafters"].clear()
    alone = Engine.from_config(cfg, target_only=True)
    (draft_arg, rules), = planned
    assert draft_arg is None and rules.drafter == "none"
    assert alone.drafter is None and spy["drafters"] == [] and set(spy["loaded"]) <= {"target"}
    assert alone.plan.best.k == 0
    assert alone.generate_ids(PROMPT).token_ids == full.generate_ids(PROMPT, target_only=True).token_ids


def test_a_speculative_engine_still_runs_target_only_requests(tiny_model_dir, tmp_path):
    cfg = _yaml(tmp_path, tiny_model_dir("llama"), "kind: ngram, k: 3")
    engine = Engine.from_config(cfg)
    assert engine.drafter is not None
    assert engine.generate_ids(PROMPT, target_only=True).stats.mode == "target-only"
    with pytest.raises(ModelLoadError):
        Engine.from_config(_yaml(tmp_path, tmp_path / "no-target", "kind: ngram"), target_only=True)
