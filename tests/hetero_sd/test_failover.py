"""A device that fails mid-generation costs speed, never output.

Fake devices (hetero_sd/testing/fake_backend.py) wrap the real torch CPU runner, so a
replacement device has the same numerics and the output after a failover must
be token-identical to an undisturbed run: for the target (replayed into the
replacement's cache) and for the drafter (dropped, replaced or not), greedy
and seeded sampling alike, failing at many points of the run.
"""
from __future__ import annotations

import json

import pytest

from hetero_sd import profiler
from hetero_sd.testing.fake_backend import ENV, FakeBackend, FakeDeviceSpec, FakeFailure, declared_figures
from hetero_sd.cli import main
from hetero_sd.drafting import ModelDrafter, NgramDrafter
from hetero_sd.engine import Engine
from hetero_sd.errors import GenerationError
from hetero_sd.failover import RankedFallback
from hetero_sd.ir import load_model_ir
from hetero_sd.sampling import SamplingParams
from helpers.tiny_models import random_prompt

BUDGET = 4 << 20


def _fake(failing_after: int | None = None, kind: str = "runtime_error") -> FakeBackend:
    failure = None if failing_after is None else FakeFailure(after_calls=failing_after, kind=kind, hang_s=0.01)
    return FakeBackend(devices=[FakeDeviceSpec(device="fake:0", failure=failure), FakeDeviceSpec(device="fake:1")])


def _prompt(seed: int) -> list[int]:
    head = random_prompt(10, seed=seed)
    return head + head[:6]  # a repeat, so the n-gram drafter proposes


@pytest.fixture(scope="module")
def ir(tiny_model_dir):
    return load_model_ir(tiny_model_dir("llama"))


@pytest.mark.parametrize("sampling", [None, SamplingParams(0.9, top_k=20, seed=3)], ids=["greedy", "sampled"])
@pytest.mark.parametrize("drafter_kind", ["ngram", "model"])
def test_target_failure_moves_to_the_next_device_token_identically(ir, drafter_kind, sampling):
    prompt, new = _prompt(1), 24
    healthy = _fake().load(ir, "fake:1", "fp32", BUDGET)

    def drafter():
        if drafter_kind == "ngram":
            return NgramDrafter(1, 3)
        return ModelDrafter(_fake().load(ir, "fake:1", "fp32", BUDGET), healthy.vocab_size)

    expected = Engine(healthy, drafter(), k=4).generate_ids(prompt, new, sampling=sampling)
    switched = 0
    for after in (0, 1, 2, 5, 9):  # 0: the prefill itself fails
        failing = _fake(after).load(ir, "fake:0", "fp32", BUDGET)
        fallback = RankedFallback(targets=[("fake:1", lambda: _fake().load(ir, "fake:1", "fp32", BUDGET))])
        engine = Engine(failing, drafter(), k=4, fallback=fallback)
        got = engine.generate_ids(prompt, new, sampling=sampling)
        assert got.token_ids == expected.token_ids, f"failure after {after} calls changed the output"
        if got.stats.events:
            switched += 1
            assert engine.target.device.device == "fake:1"
            assert any("target moved to fake:fake:1" in e for e in got.stats.events), got.stats.events
    assert switched >= 4  # most failure points fall inside the run


@pytest.mark.parametrize("kind", ["runtime_error", "backend_error", "hang"])
def test_drafter_failure_keeps_the_output(ir, kind):
    prompt, new = _prompt(2), 24
    target = _fake().load(ir, "fake:1", "fp32", BUDGET)
    expected = Engine(target, None).generate_ids(prompt, new, target_only=True).token_ids
    for after in (0, 3, 7):
        draft = _fake(after, kind).load(ir, "fake:0", "fp32", BUDGET)
        # Alone: drafting stops, the target carries on.
        alone = Engine(target, ModelDrafter(draft, target.vocab_size), k=3).generate_ids(prompt, new)
        assert alone.token_ids == expected and any("drafter model failed" in e for e in alone.stats.events)
        # With a replacement: an n-gram drafter takes over from a clean sync.
        draft = _fake(after, kind).load(ir, "fake:0", "fp32", BUDGET)
        engine = Engine(target, ModelDrafter(draft, target.vocab_size), k=3,
                        fallback=RankedFallback(drafters=[("ngram", lambda: NgramDrafter(1, 3))]))
        replaced = engine.generate_ids(prompt, new)
        assert replaced.token_ids == expected
        assert engine.drafter.name == "ngram" and replaced.stats.accepted > 0


class _Scribbler(NgramDrafter):
    """A broken drafter: it appends its own drafts to the context it was given to read."""
    name = "scribbler"

    def draft(self, req, rnd=None):
        result = super().draft(req)
        if req.context is not None:
            req.context.extend(result.tokens)
        return result


def test_a_drafter_that_writes_to_the_history_is_undone_and_dropped(ir):
    prompt, new = _prompt(2), 24
    target = _fake().load(ir, "fake:1", "fp32", BUDGET)
    expected = Engine(target, None).generate_ids(prompt, new, target_only=True).token_ids
    got = Engine(target, _Scribbler(1, 3), k=3).generate_ids(prompt, new)
    assert got.token_ids == expected
    assert any("appended to the request's token history" in e for e in got.stats.events)


def test_no_replacement_raises_with_the_output_so_far(ir):
    prompt = _prompt(3)
    healthy = _fake().load(ir, "fake:1", "fp32", BUDGET)
    full = Engine(healthy, None).generate_ids(prompt, 30).token_ids
    failing = _fake(6).load(ir, "fake:0", "fp32", BUDGET)
    with pytest.raises(GenerationError, match="no other device can take it") as info:
        Engine(failing, NgramDrafter(1, 3), k=3).generate_ids(prompt, 30)
    partial = info.value.partial
    assert 0 < len(partial.token_ids) < 30
    assert partial.token_ids == full[:len(partial.token_ids)]  # nothing lost, nothing corrupted
    assert partial.stats.new_tokens == len(partial.token_ids)


def _env(monkeypatch, fail_after: int | None):
    """Two fake devices: fake:0 declares itself 4x faster than fake:1. The profiler
    reads the declared costs (no clock), so placement: auto's choice is fixed."""
    monkeypatch.setattr(profiler, "measure_runner", declared_figures)
    devices = [{"device": "fake:0", "description": "fast, fails",
                "costs": {"decode_per_token_s": 0.001, "verify_base_s": 0.001, "prefill_per_token_s": 1e-5},
                **({"failure": {"after_calls": fail_after, "kind": "runtime_error"}} if fail_after else {})},
               {"device": "fake:1", "description": "slower",
                "costs": {"decode_per_token_s": 0.004, "verify_base_s": 0.004, "prefill_per_token_s": 1e-5}}]
    monkeypatch.setenv(ENV, json.dumps({"simulate_time": False, "devices": devices}))


def test_auto_placement_replans_when_its_device_fails(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """placement: auto picks the faster fake device; when it fails mid-run the plan
    moves the target to the next device, and the text is what an undisturbed run gives."""
    cfg = tmp_path / "auto.yaml"
    cfg.write_text(f"placement: auto\ntarget: {{model: {tiny_model_dir('llama')}, backend: fake}}\n"
                   "drafter: {kind: ngram, k: 3}\ngeneration: {max_new_tokens: 20}\n"
                   "auto: {quick: true, backends: [fake], precisions: [fp32]}\nmemory: {kv_budget: 4MiB}\n")
    args = ["generate", "--config", str(cfg), "--prompt", "a b c a b c a b", "--no-chat-template", "--json"]
    _env(monkeypatch, None)
    assert main(args + ["--explain"]) == 0
    out, err = capsys.readouterr()
    undisturbed = json.loads(out)
    assert "fake:fake:0/fp32" in err.splitlines()[0]  # the plan chose the fast device
    _env(monkeypatch, 4)
    assert main(args) == 0
    out, _ = capsys.readouterr()
    disturbed = json.loads(out)
    assert disturbed["token_ids"] == undisturbed["token_ids"]
    assert any("fake:fake:0 failed" in e for e in disturbed["stats"]["events"])
    assert any("target moved to fake:fake:1" in e for e in disturbed["stats"]["events"])


def test_cli_prints_partial_output_before_the_error(tiny_model_dir, tmp_path, monkeypatch, capsys):
    cfg = tmp_path / "manual.yaml"
    cfg.write_text(f"target: {{model: {tiny_model_dir('llama')}, backend: fake, device: 'fake:0'}}\n"
                   "drafter: {kind: none}\ngeneration: {max_new_tokens: 20}\nmemory: {kv_budget: 4MiB}\n")
    _env(monkeypatch, 5)
    code = main(["generate", "--config", str(cfg), "--prompt", "a b c", "--no-chat-template", "--json"])
    out, err = capsys.readouterr()
    assert code == 2 and "no other device can take it" in err
    partial = json.loads(out)
    assert 0 < len(partial["token_ids"]) < 20 and "error" in partial


# ------------------------------------------------------------------ acceptance drift
def _drift_plan(alpha_ngram: float):
    from hetero_sd.scheduler import CostCurve, DeviceProfile, DraftOption, Placement, Problem, plan

    target = DeviceProfile("t", Placement("torch", "cpu", "fp32"), CostCurve(((1, 1e-3), (128, 0.05))), 0.01,
                           CostCurve(((1, 0.01), (2, 0.011), (9, 0.02))))
    draft = DeviceProfile("d", Placement("onnxruntime", "cpu", "int4"), CostCurve(((1, 1e-4), (128, 0.01))),
                          0.002, CostCurve(((1, 0.002),)))
    return plan(Problem((target,), (DraftOption("ngram", alpha_ngram), DraftOption("model", 0.6, draft)), 8))


def test_drift_replans_the_drafter_and_keeps_the_target():
    from hetero_sd.auto import PlanFallback

    made = []
    fb = PlanFallback(_drift_plan(0.95), lambda p: None, lambda cand: made.append(cand) or cand.drafter_label)
    assert fb.drafter_label == "ngram"  # an optimistic n-gram estimate wins at first
    swaps = [fb.on_round(4, 4) for _ in range(64)]  # acceptance as estimated: no change
    assert swaps == [None] * 64 and not made
    for rounds in range(1, 65):  # then nothing is accepted: within two checks the plan moves
        swap = fb.on_round(4, 0)
        if swap is not None:
            break
    assert swap == "model@onnxruntime:cpu/int4" == fb.drafter_label and made
    assert str(fb.plan.best.target) == "torch:cpu/fp32"  # the target stays put


class _SwapAt:
    """A Replanner (a plan stand-in) that asks for a new drafter at one round."""

    def __init__(self, at, make):
        self.at, self.make, self.rounds = at, make, 0

    def on_round(self, drafted, accepted):
        self.rounds += 1
        return self.make() if self.rounds == self.at else None


@pytest.mark.parametrize("at", [1, 3, 6])
def test_engine_swaps_drafter_on_replan_token_identically(ir, at):
    prompt, new = _prompt(4), 30
    target = _fake().load(ir, "fake:1", "fp32", BUDGET)
    expected = Engine(target, None).generate_ids(prompt, new, target_only=True).token_ids
    first = ModelDrafter(_fake().load(ir, "fake:0", "fp32", BUDGET), target.vocab_size)
    second = ModelDrafter(_fake().load(ir, "fake:1", "fp32", BUDGET), target.vocab_size)
    engine = Engine(target, first, k=3, replanner=_SwapAt(at, lambda: second))
    got = engine.generate_ids(prompt, new)
    assert got.token_ids == expected
    assert any("acceptance drifted: drafter model -> model" in e for e in got.stats.events)
    assert engine.drafter is second and got.stats.accepted > 0


def test_a_seeded_sampled_request_is_never_re_planned(ir):
    """Which drafter serves a seeded request must not follow earlier requests: its rounds
    do not feed the Replanner (whose acceptance and round counts run across requests),
    and it is not swapped mid-way; a greedy request's rounds still are."""
    from hetero_sd.sampling import SamplingParams

    prompt, new = _prompt(4), 20
    target = _fake().load(ir, "fake:1", "fp32", BUDGET)
    first = ModelDrafter(_fake().load(ir, "fake:0", "fp32", BUDGET), target.vocab_size)
    second = ModelDrafter(_fake().load(ir, "fake:1", "fp32", BUDGET), target.vocab_size)
    replanner = _SwapAt(1, lambda: second)
    engine = Engine(target, first, k=3, replanner=replanner)
    seeded = engine.generate_ids(prompt, new, sampling=SamplingParams(0.8, seed=3))
    assert replanner.rounds == 0 and engine.drafter is first and seeded.stats.drafted > 0
    engine.generate_ids(prompt, new)  # greedy: the first round asks for the swap
    assert replanner.rounds > 0 and engine.drafter is second


def test_a_replacement_serves_later_requests_and_a_dropped_drafter_is_retried(ir):
    """Failover persists by design (hetero_sd/failover.py): the next request runs on
    the replacement target without failing again, while a drafter dropped with no
    replacement is tried afresh at the next request."""
    prompt, new = _prompt(5), 20
    healthy = _fake().load(ir, "fake:1", "fp32", BUDGET)
    want = Engine(healthy, None).generate_ids(prompt, new).token_ids
    failing = _fake(3).load(ir, "fake:0", "fp32", BUDGET)
    replacements = []

    def replacement():
        replacements.append(_fake().load(ir, "fake:1", "fp32", BUDGET))
        return replacements[-1]

    once = FakeFailure(after_calls=2, kind="runtime_error", times=1)  # fails one call, then recovers
    draft_runner = FakeBackend(devices=[FakeDeviceSpec(device="fake:0", failure=once)]).load(ir, "fake:0", "fp32",
                                                                                              BUDGET)
    drafter = ModelDrafter(draft_runner, healthy.vocab_size)
    engine = Engine(failing, drafter, k=3, fallback=RankedFallback(targets=[("fake:1", replacement)]))
    first = engine.generate_ids(prompt, new)
    assert first.token_ids == want and engine.target is replacements[0]
    assert any("target moved" in e for e in first.stats.events)
    assert any("drafter model failed" in e for e in first.stats.events) and engine.drafter is drafter
    second = engine.generate_ids(prompt, new)
    assert second.token_ids == want and len(replacements) == 1  # no second failover
    assert not any("target" in e for e in second.stats.events)
    assert second.stats.drafted > 0  # the same drafter drafts again


def test_an_interrupted_request_frees_its_sequence(ir):
    """Ctrl-C (or any error that is not a device failure) mid-request still releases
    the target's sequence and resets the drafter: a long-lived engine does not leak KV."""
    from helpers.drafters import ProxyDrafter

    class Interrupting(ProxyDrafter):
        calls = 0

        def seen(self, req, result):
            Interrupting.calls += 1
            if Interrupting.calls == 3:
                raise KeyboardInterrupt
            return result

    target = _fake().load(ir, "fake:1", "fp32", BUDGET)
    engine = Engine(target, Interrupting(NgramDrafter(1, 3)), k=3)
    with pytest.raises(KeyboardInterrupt):
        engine.generate_ids(_prompt(6), 20)
    assert target.usage().sequences == 0
    assert engine.generate_ids(_prompt(6), 20).token_ids == Engine(target, None).generate_ids(_prompt(6), 20).token_ids
