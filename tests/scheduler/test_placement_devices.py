"""Placement across devices: a CPU draft beside an asynchronous (GPU-like) target,
priced with the overlap (scheduler/overlap.py), every drafter kind planned, and the
explain saying whether each pair overlaps and why.

Pure splitter tests use declared DeviceProfiles; the last ones go through
`placement: auto` and `hetero-sd profile --explain` with fake devices whose costs
are declared (profiler.measure_runner patched to read them: no clock).
"""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from hetero_sd.draft_options import KindInputs, draft_options
from hetero_sd.scheduler import (Constraints, CostCurve, DeviceProfile, DraftOption, Placement, Problem,
                                 RoundCost, plan)
from hetero_sd.scheduler.overlap import hit_rate, round_seconds

GPU = Placement("fake", "cuda:0", "bf16")
CPU = Placement("onnxruntime", "cpu", "fp32")


def _profile(place: Placement, step: float, verify_base: float, per_token: float = 5e-4,
             asynchronous: bool = False) -> DeviceProfile:
    verify = CostCurve(tuple((w, verify_base + per_token * w) for w in range(1, 10)))
    return DeviceProfile("m", place, CostCurve(((1, 1e-5), (128, 1e-3))), step, verify,
                         asynchronous=asynchronous)


def _gpu_and_cpu(cpu_step: float, gpu_step: float = 0.003, overlap: str = "auto", alpha: float = 0.9):
    """A fast asynchronous GPU-like target (20 ms verifies) and a slow CPU one; the
    draft model measured on both devices."""
    targets = (_profile(GPU, 0.02, 0.02, asynchronous=True), _profile(CPU, 0.2, 0.2))
    drafts = (DraftOption("model", alpha, _profile(CPU, cpu_step, cpu_step)),
              DraftOption("model", alpha, _profile(GPU, gpu_step, gpu_step, asynchronous=True)))
    return Problem(targets, (DraftOption("ngram", 0.5, round_s=2e-5),) + drafts, 8, overlap=overlap)


def test_a_cpu_draft_beside_a_gpu_target_wins_when_the_overlap_hides_it():
    """Serially the GPU draft (3 ms a step) beats the CPU one (4 ms); with the overlap
    the CPU draft runs during the GPU's verify, so it wins, and explain says why."""
    result = plan(_gpu_and_cpu(cpu_step=0.004))
    best = result.best
    assert best.target == GPU and best.draft_placement == CPU and best.k > 0
    assert best.overlap.on and "drafts the next round while the target verifies on cuda:0" in best.overlap.why
    gpu_draft = next(c for c in result.ranked if c.target == GPU and c.draft_placement == GPU)
    assert not gpu_draft.overlap.on and "share cuda:0" in gpu_draft.overlap.why  # same device: serial
    text = result.explain()
    assert "overlap: on: the drafter on cpu drafts the next round while the target verifies on cuda:0" in text
    assert "hidden)" in text and " overlap " in text.splitlines()[2]  # the table's column
    row = next(line for line in text.splitlines() if f"model@{GPU}" in line and line.split()[1] == str(GPU))
    assert " serial " in row


def test_without_the_overlap_the_same_costs_pick_the_gpu_draft():
    serial = plan(_gpu_and_cpu(cpu_step=0.004, overlap="off"))
    assert serial.best.draft_placement == GPU and not serial.best.overlap.on
    assert "overlap: serial: scheduler.overlap is off" in serial.explain()


def test_a_slow_cpu_draft_is_not_chosen_even_with_the_overlap():
    """A CPU draft step of 15 ms: its pre-draft outlasts the verify, the round is
    longer than the GPU draft's serial one."""
    result = plan(_gpu_and_cpu(cpu_step=0.015))
    assert result.best.target == GPU and result.best.draft_placement != CPU


def test_the_overlap_price_is_overlap_round_seconds():
    """RoundCost with the overlap prices a round as overlap.round_seconds does, and
    its branch and bound still equals trying every k."""
    verify = CostCurve(tuple((w, 0.02 + 5e-4 * w) for w in range(1, 10)))
    cost = RoundCost(verify, CostCurve.affine(1e-4, 0.004), overlap=True)
    for k in range(1, 9):
        v = verify(k + 1)
        assert cost.seconds(k, 1.0, 0.8) == pytest.approx(
            round_seconds(v, cost.draft(k), cost.draft(k + 1), hit_rate(0.8, k)))
        if cost.draft(k + 1) <= v:  # a pre-draft inside the verify: cheaper than serial
            assert cost.seconds(k, 1.0, 0.8) < RoundCost(verify, cost.draft).seconds(k)
    for alpha in (0.3, 0.6, 0.9, 0.99):
        k, rate, _ = cost.best_k(alpha, 8, 1.0, 1)
        brute = max(range(1, 9), key=lambda j: (cost.rate(alpha, j), -j))
        assert k == brute and rate == cost.rate(alpha, brute)


def test_a_synchronous_target_runs_serially_and_explain_says_so():
    problem = Problem((_profile(CPU, 0.02, 0.02),), (DraftOption("model", 0.9, _profile(GPU, 0.003, 0.003)),), 8)
    result = plan(problem)
    spec = result.speculative_for(CPU)
    assert not spec.overlap.on and "synchronous" in spec.overlap.why
    assert "overlap: serial: the target's runner on cpu is synchronous" in result.explain()


def test_a_drafter_on_the_targets_own_device_runs_serially():
    target = _profile(GPU, 0.02, 0.02, asynchronous=True)
    result = plan(Problem((target,), (DraftOption("model", 0.9, _profile(GPU, 0.001, 0.001)),), 8))
    assert result.best.k > 0 and not result.best.overlap.on
    assert "overlap: serial: the drafter and the target share cuda:0, which cannot run both at once" \
        in result.explain()


def _every_kind(head: bool = True, workers: bool = True):
    gpu = _profile(GPU, 0.02, 0.02, asynchronous=True)
    cpu = _profile(CPU, 0.2, 0.2)
    targets = (gpu, cpu)
    draft = _profile(CPU, 0.004, 0.004)
    stage = _profile(GPU, 0.008, 0.008, asynchronous=True)  # an intermediate model
    inputs = KindInputs(drafts=(draft,), head_fraction=0.1 if head else None, no_head="no trained head here",
                        stages=((stage,),), workers=workers)
    options, unplanned = draft_options(targets, {"model": 0.8}, 2e-5, inputs, 8)
    return Problem(targets, tuple(options), 8, unplanned=tuple(unplanned))


def test_the_splitter_plans_every_drafter_kind():
    problem = _every_kind()
    result = plan(problem)
    kinds = {c.drafter for c in result.ranked}
    assert kinds == {"none", "ngram", "suffix", "model", "head", "hybrid", "cascade"}
    assert {c.process for c in result.ranked} == {"inproc", "worker"}
    assert problem.unplanned == ()
    head = next(c for c in result.ranked if c.drafter == "head" and c.target == GPU)
    assert head.draft_placement == GPU and not head.overlap.on and "hidden states" in head.overlap.why
    assert not any(c.drafter == "head" and c.target == CPU and c.draft_placement == GPU for c in result.ranked)
    cascade = next(c for c in result.ranked if c.drafter == "cascade" and c.target == GPU)
    assert cascade.drafter_label == f"cascade(model@{CPU}>stage@{GPU})"
    worker = next(c for c in result.ranked if c.process == "worker" and c.drafter == "model" and c.target == GPU)
    assert worker.overlap.on and worker.option.link_s > 0 and worker.drafter_label.endswith("[worker]")
    assert worker.option.device == "worker:cpu"  # its own cores
    on_gpu = replace(worker.option, profile=_profile(GPU, 0.004, 0.004))
    assert on_gpu.device == "cuda:0"  # a worker on the target's accelerator shares it
    hybrids = {c.drafter_label for c in result.ranked if c.drafter == "hybrid"}
    assert f"hybrid(suffix+head)@{GPU}" in hybrids and f"hybrid(suffix+model)@{CPU}" in hybrids
    text = result.explain()
    assert "estimated: head" in text and "draft step is an estimate" in text


@pytest.mark.parametrize("kind", ["ngram", "suffix", "model", "head", "hybrid", "cascade"])
def test_each_kind_alone_is_planned_when_the_config_names_it(kind):
    result = plan(replace(_every_kind(), constraints=Constraints(drafter=kind)))
    assert {c.drafter for c in result.ranked} == {"none", kind}
    spec = result.speculative_for(result.best.target)
    assert spec is not None and spec.drafter == kind and spec.overlap.why


def test_a_kind_that_cannot_be_planned_says_why():
    problem = _every_kind(head=False, workers=False)
    assert ("head", "no trained head here") in problem.unplanned
    text = plan(problem).explain()
    assert "not planned: head (no trained head here)" in text
    assert "not planned: worker (" in text
    assert not any(c.drafter == "head" for c in plan(problem).ranked)
    assert any(c.drafter == "hybrid" for c in plan(problem).ranked)  # hybrid over the draft model still is


def test_replan_takes_acceptance_for_every_kind():
    from hetero_sd.scheduler import replan

    first = plan(_every_kind())
    again = replan(first, acceptance={"suffix": 0.99, "head": 0.1})
    assert all(c.alpha == 0.99 for c in again.ranked if c.drafter == "suffix")
    with pytest.raises(ValueError, match="drafter kinds"):
        replan(first, acceptance={"eagle": 0.5})


# ------------------------------------------------------------------ through placement: auto
def _fake_devices(monkeypatch, tmp_path, cpu_step: float, tag: str):
    """fake:g<tag> an asynchronous GPU stand-in, fake:c<tag> a CPU-like one; the draft
    model (llama-s1) declares its own step on each. Device names per test: profiles
    are cached per device."""
    from hetero_sd import profiler
    from hetero_sd.testing.fake_backend import ENV, declared_figures

    monkeypatch.setenv("HETERO_SD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(profiler, "measure_runner", declared_figures)
    gpu = {"prefill_per_token_s": 1e-5, "decode_per_token_s": 0.02, "verify_base_s": 0.02, "verify_per_token_s": 5e-4}
    cpu = {"prefill_per_token_s": 1e-4, "decode_per_token_s": 0.2, "verify_base_s": 0.2, "verify_per_token_s": 5e-3}
    draft = {"prefill_per_token_s": 1e-5, "verify_base_s": 0.003, "verify_per_token_s": 5e-4}
    devices = [{"device": f"fake:g{tag}", "asynchronous": True, "costs": gpu,
                "model_costs": {"llama-s1": {**draft, "decode_per_token_s": 0.003}}},
               {"device": f"fake:c{tag}", "costs": cpu,
                "model_costs": {"llama-s1": {**draft, "decode_per_token_s": cpu_step}}}]
    monkeypatch.setenv(ENV, json.dumps({"simulate_time": False, "devices": devices}))
    return f"fake:g{tag}", f"fake:c{tag}"


def _auto_config(tmp_path, tiny_model_dir, overlap: str = "auto") -> str:
    path = tmp_path / "auto.yaml"
    path.write_text(f"placement: auto\ntarget: {{model: {tiny_model_dir('llama')}}}\n"
                    f"drafter: {{kind: auto, model: {tiny_model_dir('llama', seed=1)}}}\n"
                    "generation: {max_new_tokens: 64}\nmemory: {kv_budget: 1MiB}\n"
                    f"scheduler: {{overlap: '{overlap}'}}\n"
                    "auto: {quick: true, backends: [fake], precisions: [fp32], acceptance: {model: 0.9}}\n")
    return str(path)


def _plan_engine(path):
    from hetero_sd.auto import plan_engine
    from hetero_sd.backends.registry import discover
    from hetero_sd.config import load_config
    from hetero_sd.loading import Loader
    from hetero_sd.options import config_options

    cfg = load_config(path)
    options = config_options(cfg)
    return plan_engine(cfg, Loader(discover(options), options=options))


def test_placement_auto_picks_the_cpu_draft_for_the_gpu_target(tiny_model_dir, tmp_path, monkeypatch):
    gpu, cpu = _fake_devices(monkeypatch, tmp_path, cpu_step=0.004, tag="71")
    spec, _, _, result = _plan_engine(_auto_config(tmp_path, tiny_model_dir))
    assert result.best.target.device == gpu and result.best.draft_placement.device == cpu
    assert spec.target.device == gpu and spec.drafter.device == cpu
    text = result.explain()
    assert f"overlap: on: the drafter on {cpu} drafts the next round while the target verifies on {gpu}" in text
    assert "not planned: head (no trained head:" in text  # kind auto plans a head where one is found


def test_placement_auto_without_the_overlap_keeps_the_draft_beside_the_target(tiny_model_dir, tmp_path,
                                                                             monkeypatch):
    gpu, _ = _fake_devices(monkeypatch, tmp_path, cpu_step=0.004, tag="72")
    _, _, _, result = _plan_engine(_auto_config(tmp_path, tiny_model_dir, overlap="off"))
    assert result.best.target.device == gpu and result.best.draft_placement.device == gpu
    assert "overlap: serial: scheduler.overlap is off" in result.explain()


def test_placement_auto_with_a_slow_cpu_draft_does_not_choose_it(tiny_model_dir, tmp_path, monkeypatch):
    gpu, cpu = _fake_devices(monkeypatch, tmp_path, cpu_step=0.015, tag="73")
    _, _, _, result = _plan_engine(_auto_config(tmp_path, tiny_model_dir))
    assert result.best.target.device == gpu
    assert result.best.draft_placement is None or result.best.draft_placement.device != cpu


def test_profile_explain_shows_every_kind_and_the_overlap(tiny_model_dir, tmp_path, monkeypatch, capsys):
    from hetero_sd.cli import main

    gpu, cpu = _fake_devices(monkeypatch, tmp_path, cpu_step=0.004, tag="74")
    path = tmp_path / "manual.yaml"
    path.write_text(f"target: {{model: {tiny_model_dir('llama')}}}\n"
                    f"drafter: {{kind: model, model: {tiny_model_dir('llama', seed=1)}, "
                    f"stages: [{{model: {tiny_model_dir('llama', seed=1)}}}]}}\n"
                    "memory: {kv_budget: 1MiB}\nauto: {acceptance: {model: 0.9}}\n")
    assert main(["profile", "--config", str(path), "--backends", "fake", "--precisions", "fp32", "--quick",
                 "--explain", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {(e["device"], e["asynchronous"]) for e in out["profiles"]} == {(gpu, True), (cpu, False)}
    best = out["plan"]["best"]
    assert best["target"] == f"fake:{gpu}/fp32" and best["draft_placement"] == f"fake:{cpu}/fp32"
    assert best["overlap"] and "drafts the next round" in best["overlap_why"]
    text = out["plan"]["explain"]
    for label in ("ngram", "suffix", "model@", "cascade(", "[worker]"):
        assert label in text
    assert "not planned: head (no trained head" in text
