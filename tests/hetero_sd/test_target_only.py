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
    """What got built: the roles the Loader loaded, and every drafter the builder built."""
    seen = {"loaded": [], "drafters": []}
    load, make = Loader.__call__, build.build_for_target
    monkeypatch.setattr(Loader, "__call__", lambda self, spec: seen["loaded"].append(spec.role) or load(self, spec))
    monkeypatch.setattr(build, "build_for_target",
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


# Two fake devices: fake:0 decodes faster, fake:1 verifies drafts far cheaper (and computes
# in bf16, so a baseline on the wrong device would not even produce the same tokens).
def _faster_precision() -> str:
    """What the faster fake device runs as: bf16 (numerics apart from fp32's) where torch has
    it on this CPU; else fp32, so a host without bf16 still runs the placement path."""
    from hetero_sd.backends.registry import discover

    offered = {p.name for info in discover().get("torch").probe() for p in info.precisions}
    return "bf16" if "bf16" in offered else "fp32"


_TWO_DEVICES = {"simulate_time": False, "devices": [
    {"device": "fake:0", "costs": {"decode_per_token_s": 0.004, "verify_base_s": 0.004,
                                   "verify_per_token_s": 0.004, "prefill_per_token_s": 1e-5}},
    {"device": "fake:1", "precisions": [{"name": "fp32", "runs_as": _faster_precision()}],
     "costs": {"decode_per_token_s": 0.005, "verify_base_s": 0.005, "verify_per_token_s": 0.0002,
               "prefill_per_token_s": 1e-5}}]}


def test_auto_placement_target_only_keeps_the_plans_target(tiny_model_dir, tmp_path, monkeypatch, spy, capsys):
    """--target-only runs the target the full plan verifies on, not a plan of its own
    (which would pick the faster decoder): the baseline's output is what the
    speculative run must equal. No draft model loads for it."""
    monkeypatch.setattr(profiler, "measure_runner", declared_figures)  # declared costs, no clock
    monkeypatch.setenv(ENV, json.dumps(_TWO_DEVICES))
    cfg_path = _yaml(tmp_path, tiny_model_dir("llama"), f"kind: ngram, k: auto",
                     "placement: auto\nauto: {quick: true, backends: [fake], precisions: [fp32]}\n")
    cfg = load_config(cfg_path)
    full = Engine.from_config(cfg)
    assert full.target.device.device == "fake:1" and full.drafter is not None
    alone_first = min((c for c in full.plan.ranked if c.k == 0), key=lambda c: -c.tokens_per_s)
    assert alone_first.target.device == "fake:0"  # the placement a target-only plan would have taken
    spy["loaded"].clear(), spy["drafters"].clear()
    alone = Engine.from_config(cfg, target_only=True)
    assert alone.target.device.device == full.target.device.device
    assert alone.target.precision == full.target.precision
    assert alone.drafter is None and spy["drafters"] == [] and spy["loaded"] == ["target"]
    assert alone.generate_ids(PROMPT).token_ids == full.generate_ids(PROMPT).token_ids
    assert main(["generate", "--config", cfg_path, "--target-only", "--explain", "--prompt", "hi",
                 "--no-chat-template", "--json"]) == 0
    assert "--target-only: fake:fake:1/fp32 alone" in capsys.readouterr().err


def test_auto_target_only_with_a_missing_draft_model_plans_the_target_alone(tiny_model_dir, tmp_path, monkeypatch,
                                                                           capsys):
    """No speculative plan can be made without the draft model: the baseline still runs,
    planned alone, and says that its placement may not be a speculative run's."""
    monkeypatch.setattr(profiler, "measure_runner", declared_figures)
    monkeypatch.setenv(ENV, json.dumps(_TWO_DEVICES))
    cfg = load_config(_yaml(tmp_path, tiny_model_dir("llama"), f"kind: model, model: {tmp_path / 'no-draft'}",
                            "placement: auto\nauto: {quick: true, backends: [fake], precisions: [fp32]}\n"))
    with pytest.raises(ModelLoadError):
        Engine.from_config(cfg)
    alone = Engine.from_config(cfg, target_only=True)
    assert alone.drafter is None and alone.target.device.device == "fake:0"  # the faster decoder, planned alone
    assert "the drafter section cannot be planned" in capsys.readouterr().err
    assert alone.generate_ids(PROMPT).token_ids


def test_auto_yaml_target_only_is_the_speculative_runs_target(smollm2_gguf):
    """configs/auto.yaml (the splitter narrowed to onnxruntime, quick, so the test
    profiles in seconds): the baseline runs on the plan's target, and every
    packaged prompt's greedy output equals the speculative run's."""
    from hetero_sd.bench.prompts import load_prompts
    from hetero_sd.config import PACKAGED

    overrides = {"auto.backends": ["onnxruntime"], "auto.quick": True, "generation.max_new_tokens": 24}
    cfg = load_config(PACKAGED / "auto.yaml", overrides)
    spec = Engine.from_config(cfg)
    alone = Engine.from_config(cfg, target_only=True)
    assert (alone.target.device, alone.target.precision) == (spec.target.device, spec.target.precision)
    assert alone.drafter is None and spec.drafter is not None
    prompts = load_prompts()
    assert len(prompts) >= 10
    for prompt in prompts:
        want = alone.generate(prompt.prompt)
        got = spec.generate(prompt.prompt)
        assert got.token_ids == want.token_ids, prompt.id
        assert want.stats.mode == "target-only" and got.stats.mode != "target-only"


def test_a_speculative_engine_still_runs_target_only_requests(tiny_model_dir, tmp_path):
    cfg = _yaml(tmp_path, tiny_model_dir("llama"), "kind: ngram, k: 3")
    engine = Engine.from_config(cfg)
    assert engine.drafter is not None
    assert engine.generate_ids(PROMPT, target_only=True).stats.mode == "target-only"
    with pytest.raises(ModelLoadError):
        Engine.from_config(_yaml(tmp_path, tmp_path / "no-target", "kind: ngram"), target_only=True)
