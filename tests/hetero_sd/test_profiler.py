"""`hetero-sd profile`: measuring tiny models on torch and onnxruntime, the cache, the table,
errors, and the hand-over to the splitter."""
from __future__ import annotations

import argparse
import json

import pytest

from hetero_sd import profile_cli, profiler
from hetero_sd.backends.base import DeviceInfo, PrecisionInfo
from hetero_sd.backends.options import BackendOptions
from hetero_sd.backends.registry import Registry, discover
from hetero_sd.errors import BackendError, ConfigError
from hetero_sd.scheduler import Constraints, Placement, plan

PLACES = ["--backends", "torch,onnxruntime", "--precisions", "fp32"]


@pytest.fixture
def cfg(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HETERO_SD_CACHE", str(tmp_path / "cache"))  # a cache of its own: the first run measures
    path = tmp_path / "tiny.yaml"
    path.write_text(f"target: {{model: {tiny_model_dir('llama')}}}\n"
                    f"drafter: {{kind: model, model: {tiny_model_dir('llama', seed=1)}, k: 3}}\n"
                    "memory: {kv_budget: 1MiB}\n")
    return str(path)


@pytest.fixture
def measured(monkeypatch):
    """Counts the runners actually measured (a cache hit measures none)."""
    calls = []
    real = profiler.measure_runner

    def counting(runner, settings):
        calls.append((runner.device.backend, runner.precision.name))
        return real(runner, settings)

    monkeypatch.setattr(profiler, "measure_runner", counting)
    return calls


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="hetero-sd")
    profile_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["profile", *argv])
    return args.func(args)


def run_json(capsys, *argv: str) -> dict:
    assert cli(*argv, "--json") == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1
    return json.loads(out[0])


def test_profile_json_shape_cache_and_refresh(cfg, capsys, measured):
    first = run_json(capsys, "--config", cfg, "--quick", *PLACES)
    assert set(first["host"]) == {"hostname", "cpu", "cores"} and first["failures"] == []
    profiles = first["profiles"]
    # two models x two placements, each measured once
    assert sorted((p["role"], p["backend"], p["precision"]) for p in profiles) == [
        ("draft", "onnxruntime", "fp32"), ("draft", "torch", "fp32"),
        ("target", "onnxruntime", "fp32"), ("target", "torch", "fp32")]
    assert len(measured) == 4
    for p in profiles:
        assert [w for w, _ in p["verify"]] == [1, 2, 3, 4, 5]  # quick: k_max 4, widths 1..k_max+1
        assert [n for n, _ in p["prefill"]] == [8, 24]
        assert p["decode_s"] > 0 and all(s > 0 for _, s in p["verify"] + p["prefill"])
        assert p["exact"] is True and p["cached"] is False
    assert first["ngram_round_s"] > 0

    second = run_json(capsys, "--config", cfg, "--quick", *PLACES)
    assert len(measured) == 4  # nothing measured again
    assert all(p["cached"] for p in second["profiles"])
    strip = [{k: v for k, v in p.items() if k != "cached"} for p in first["profiles"]]
    assert [{k: v for k, v in p.items() if k != "cached"} for p in second["profiles"]] == strip

    third = run_json(capsys, "--config", cfg, "--quick", "--refresh", *PLACES)
    assert len(measured) == 8 and not any(p["cached"] for p in third["profiles"])


def test_cache_is_keyed_by_host_and_settings(cfg, capsys, measured, monkeypatch):
    run_json(capsys, "--config", cfg, "--quick", "--backends", "onnxruntime", "--precisions", "fp32")
    assert len(measured) == 2
    run_json(capsys, "--config", cfg, "--quick", "--k-max", "2", "--backends", "onnxruntime", "--precisions", "fp32")
    assert len(measured) == 4  # other widths: another profile
    monkeypatch.setattr(profiler, "host_identity", lambda: {"hostname": "elsewhere", "cpu": "x", "cores": 1})
    run_json(capsys, "--config", cfg, "--quick", "--backends", "onnxruntime", "--precisions", "fp32")
    assert len(measured) == 6


def test_table_and_explain(cfg, capsys):
    assert cli("--config", cfg, "--quick", "--explain", "--alpha-ngram", "0.9", *PLACES) == 0
    out = capsys.readouterr().out
    for place in ("torch:cpu/fp32", "onnxruntime:cpu/fp32"):
        assert place in out
    assert "measured" in out and "n-gram lookup" in out
    assert "plan: " in out and "ngram 0.90" in out and "why:" in out
    data = run_json(capsys, "--config", cfg, "--quick", "--explain", *PLACES)
    assert data["plan"]["best"]["target"] in ("torch:cpu/fp32", "onnxruntime:cpu/fp32")
    assert data["plan"]["explain"].startswith("plan: ")


@pytest.mark.parametrize("argv,error,match", [
    (["--backends", "nosuch"], BackendError, "unknown backend 'nosuch'.*available: .*torch"),
    (["--backends", "torch", "--precisions", "int3"], ConfigError, "no placement matches.*torch:cpu/fp32"),
    (["--k-max", "40"], ConfigError, "--k-max must be in 1..16"),
])
def test_bad_options_are_clear_errors(cfg, argv, error, match):
    with pytest.raises(error, match=match):
        cli("--config", cfg, "--quick", *argv)


class _BrokenBackend:
    """Probes fine, fails to load: the profiler reports it and carries on."""

    name, api_version = "broken", 1

    def probe(self):
        return [DeviceInfo("broken", "dev:0", "a device that cannot load", (PrecisionInfo("fp32", True),), "fp32")]

    def load(self, *args, **kwargs):
        raise RuntimeError("out of device memory")


def test_a_placement_that_fails_is_reported_not_fatal(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HETERO_SD_CACHE", str(tmp_path))
    registry = Registry(backends={"onnxruntime": discover().get("onnxruntime"), "broken": _BrokenBackend()})
    report = profiler.profile_models([tiny_model_dir("llama")], precisions=["fp32"],
                                     settings=profiler.ProfileSettings.quick(2), registry=registry)
    assert [str(e.placement) for e in report.entries] == ["onnxruntime:cpu/fp32"]
    assert report.failures == [{"model": tiny_model_dir("llama").name, "model_path": str(tiny_model_dir("llama")),
                                "placement": "broken:dev:0/fp32", "error": "RuntimeError: out of device memory"}]


def test_report_feeds_the_splitter(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HETERO_SD_CACHE", str(tmp_path))
    target, draft = tiny_model_dir("llama"), tiny_model_dir("llama", seed=1)
    report = profiler.profile_models([target, draft], ["torch", "onnxruntime"], ["fp32"],
                                     profiler.ProfileSettings.quick(3))
    problem = profiler.build_problem(report, target, draft, {"ngram": 0.8})
    assert {str(t.placement) for t in problem.targets} == {"torch:cpu/fp32", "onnxruntime:cpu/fp32"}
    assert sorted(str(d) for d in problem.drafters) == [
        "model@onnxruntime:cpu/fp32", "model@torch:cpu/fp32", "ngram"]
    assert problem.k_max == 3 and problem.drafters[0].alpha == 0.8 and problem.drafters[1].alpha == 0.7
    result = plan(problem)
    assert len(result.ranked) == 2 * (1 + 3)  # per target: target-only, n-gram, two draft placements
    entry = report.for_model(target)[0]
    assert entry.to_profile().verify(2) == entry.verify[1][1]
    with pytest.raises(ConfigError, match="no profile of the target model"):
        profiler.build_problem(report, tmp_path / "other-model")
    assert Placement.parse(str(entry.placement)) == entry.placement


def test_auto_plan_respects_a_pinned_target_and_reuses_the_cache(tiny_model_dir, tmp_path, monkeypatch, measured):
    monkeypatch.setenv("HETERO_SD_CACHE", str(tmp_path))
    target = tiny_model_dir("llama")
    pinned = Constraints(target=Placement("onnxruntime", "cpu", "int8"))
    result = profiler.auto_plan(target, constraints=pinned, k_max=3, backends=["onnxruntime"],
                                precisions=["fp32", "int8"], quick=True)
    assert {str(c.target) for c in result.ranked} == {"onnxruntime:cpu/int8"}
    assert {c.drafter for c in result.ranked} == {"none", "ngram"}
    assert any("config fixes the target" in why for _, why in result.excluded)
    again = profiler.auto_plan(target, k_max=3, backends=["onnxruntime"], precisions=["fp32", "int8"], quick=True)
    assert len(measured) == 2  # the second plan came from the cache
    assert {str(c.target) for c in again.ranked} == {"onnxruntime:cpu/int8", "onnxruntime:cpu/fp32"}


def test_a_draft_of_another_tokenizer_is_profiled_and_planned(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """A pair whose tokenizers differ (drafting/cross_vocab.py) is measured, named as such, and
    planned; a hybrid with `hybrid_with: model` profiles its draft model too."""
    from helpers.tiny_models import make_hf_model

    monkeypatch.setenv("HETERO_SD_CACHE", str(tmp_path / "cache"))
    draft = make_hf_model(tmp_path / "draft", "llama", seed=1, vocab_size=320)
    for drafter in (f"{{kind: model, model: {draft}, k: 3}}",
                    f"{{kind: hybrid, hybrid_with: model, model: {draft}, k: 3}}"):
        path = tmp_path / "pair.yaml"
        path.write_text(f"target: {{model: {tiny_model_dir('llama')}}}\ndrafter: {drafter}\n"
                        "memory: {kv_budget: 1MiB}\n")
        data = run_json(capsys, "--config", str(path), "--quick", "--explain", "--backends", "torch",
                        "--precisions", "fp32")
        roles = {e["role"] for e in data["profiles"]}
        assert roles == {"target", "draft (another tokenizer: drafts via text)"}, roles
        assert data["plan"]["best"]["target"] == "torch:cpu/fp32"


def test_a_draft_step_is_measured_as_the_runner_drafts(tiny_model_dir, tmp_path, monkeypatch):
    """The draft-role step is timed after Runner.draft_only (a padded target's drafts run
    unpadded), the kernel recorded is the target's, and the splitter costs a draft model
    with that step while the target keeps its own."""
    monkeypatch.setenv("HETERO_SD_CACHE", str(tmp_path))
    calls = []  # (drafting yet, tokens) per call
    real_measure = profiler.measure_runner

    def spying(runner, settings):
        state = {"drafting": False}
        real_greedy, real_draft_only = runner.greedy, runner.draft_only
        target_kernel = runner.kernel_choice

        def greedy(seq, tokens, *args):
            calls.append((state["drafting"], len(tokens)))
            return real_greedy(seq, tokens, *args)

        def draft_only():
            state["drafting"] = True
            real_draft_only()

        runner.greedy, runner.draft_only = greedy, draft_only
        figures = real_measure(runner, settings)
        assert figures["kernel"] == target_kernel and "padded" in target_kernel
        return figures

    monkeypatch.setattr(profiler, "measure_runner", spying)
    target, draft = tiny_model_dir("llama"), tiny_model_dir("llama", seed=1)
    settings = profiler.ProfileSettings.quick(2)
    padded = BackendOptions(pad_single_row="pairs")  # padded as a target, on any host
    report = profiler.profile_models([target, draft], ["onnxruntime"], ["int8"], settings, options=padded)
    assert not report.failures
    per_model = 1 + settings.repeats  # a warm-up and the repeats, each of decode_steps one-token calls
    drafting = [n for d, n in calls if d]
    assert drafting == [1] * (2 * per_model * settings.decode_steps)  # only one-token calls, after draft_only
    assert all(not d for d, _ in calls[:len(calls) // 2 - per_model * settings.decode_steps])
    for entry in report.entries:
        assert entry.draft_decode_s > 0 and "draft_only" not in entry.kernel
        assert entry.to_profile(draft=True).decode_s == entry.draft_decode_s
        assert entry.to_profile().decode_s == entry.decode_s
    problem = profiler.build_problem(report, target, draft)
    [model] = [d for d in problem.drafters if d.kind == "model"]
    assert model.profile.decode_s == report.for_model(draft)[0].draft_decode_s
    assert problem.targets[0].decode_s == report.for_model(target)[0].decode_s
