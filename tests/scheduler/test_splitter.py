"""The splitter against an independent brute force, its tie-break, constraints and re-planning."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetero_sd.errors import BackendError, ConfigError
from hetero_sd.scheduler import (AcceptanceTracker, Constraints, CostCurve, DeviceProfile, DraftOption, Placement,
                                 Problem, Workload, plan, replan, replan_if_drifted)
from hetero_sd.scheduler.splitter import matches

DEVICES = [("torch", "cpu"), ("onnxruntime", "cpu"), ("openvino", "CPU"), ("fake", "fake:0"), ("fake", "fake:1")]


# ------------------------------------------------------------------ an independent brute force
def _interp(points, n):
    """Piecewise-linear, flat below the first point, last slope (>= 0) beyond the last."""
    if n <= points[0][0]:
        return points[0][1]
    for (n0, s0), (n1, s1) in zip(points, points[1:]):
        if n <= n1:
            return s0 + (s1 - s0) * (n - n0) / (n1 - n0)
    if len(points) == 1:
        return points[-1][1]
    (n0, s0), (n1, s1) = points[-2], points[-1]
    return s1 + max(0.0, (s1 - s0) / (n1 - n0)) * (n - n1)


def brute_force(targets, drafters, k_max, workload, failed=frozenset()):
    """Every (target, drafter, k) the model allows, scored from first principles."""
    out = []
    for t in targets:
        if not t["exact"] or t["device"] in failed:
            continue
        pre_t = _interp(t["prefill"], workload[0]) if workload else 0.0
        options = [("none", None, 0)] + [("d", d, k) for d in drafters for k in range(1, k_max + 1)
                                         if d["device"] is None or d["device"] not in failed]
        for kind, d, k in options:
            v1 = _interp(t["verify"], 1)
            if d is None:
                tokens, seconds, pre_d, label = 1.0, v1, 0.0, ("none", None)
            else:
                a, h = d["alpha"], d["hit"]
                expected = sum(a ** i for i in range(k + 1))
                tokens = h * expected + (1 - h)
                seconds = d["round_s"] + k * d["per_token"] + h * _interp(t["verify"], k + 1) + (1 - h) * v1
                pre_d = _interp(d["prefill"], workload[0]) if workload and d["prefill"] else 0.0
                label = (d["kind"], d["place"])
            rate = tokens / seconds
            total = workload[1] / (pre_t + pre_d + workload[1] / rate) if workload else rate
            out.append((total, t["place"], label, k))
    return out


# ------------------------------------------------------------------ random cost tables
def _curve(draw, max_size):
    sizes = draw(st.lists(st.integers(1, max_size), min_size=1, max_size=6, unique=True))
    return tuple((n, draw(st.floats(1e-4, 0.05))) for n in sorted(sizes))


@st.composite
def problems(draw):
    k_max = draw(st.integers(1, 16))
    places = draw(st.lists(st.sampled_from(DEVICES), min_size=1, max_size=4, unique=True))
    precisions = ["fp32", "int8", "bf16"]
    targets, raw_t = [], []
    for i, (backend, device) in enumerate(places):
        place = Placement(backend, device, draw(st.sampled_from(precisions)))
        verify = ((1, draw(st.floats(1e-3, 0.05))),) + tuple(
            (n, s) for n, s in _curve(draw, k_max + 1) if n > 1)
        prefill, exact = _curve(draw, 512), draw(st.booleans()) or i == 0
        targets.append(DeviceProfile("target", place, CostCurve(prefill), verify[0][1], CostCurve(verify), exact))
        raw_t.append({"place": place, "device": place.device_key, "verify": verify, "prefill": prefill,
                      "exact": exact})
    drafters, raw_d = [], []
    alpha_s = st.one_of(st.just(0.0), st.just(1.0), st.floats(0.0, 1.0))
    if draw(st.booleans()):
        a, h, r = draw(alpha_s), draw(st.one_of(st.just(1.0), st.floats(0.0, 1.0))), draw(st.floats(0.0, 1e-3))
        drafters.append(DraftOption("ngram", a, round_s=r, hit_rate=h))
        raw_d.append({"kind": "ngram", "place": None, "device": None, "alpha": a, "hit": h, "round_s": r,
                      "per_token": 0.0, "prefill": None})
    for backend, device in draw(st.lists(st.sampled_from(DEVICES), max_size=3, unique=True)):
        place = Placement(backend, device, "fp32")
        decode, prefill, a = draw(st.floats(1e-4, 0.02)), _curve(draw, 512), draw(alpha_s)
        prof = DeviceProfile("draft", place, CostCurve(prefill), decode, CostCurve(((1, decode),)))
        drafters.append(DraftOption("model", a, prof))
        raw_d.append({"kind": "model", "place": place, "device": place.device_key, "alpha": a, "hit": 1.0,
                      "round_s": 0.0, "per_token": decode, "prefill": prefill})
    workload = draw(st.one_of(st.none(), st.tuples(st.integers(1, 512), st.integers(1, 256))))
    problem = Problem(tuple(targets), tuple(drafters), k_max, Constraints(),
                      Workload(*workload) if workload else None)
    return problem, raw_t, raw_d


@settings(max_examples=300, deadline=None)
@given(problems())
def test_choice_equals_brute_force_optimum(case):
    problem, raw_t, raw_d = case
    result = plan(problem)
    brute = brute_force(raw_t, raw_d, problem.k_max,
                        (problem.workload.prompt_tokens, problem.workload.new_tokens) if problem.workload else None)
    brute.sort(key=lambda c: -c[0])
    best = result.best
    assert best.tokens_per_s == pytest.approx(brute[0][0], rel=1e-9)
    runner_up = next((c[0] for c in brute[1:] if c[1:] != brute[0][1:]), 0.0)
    if runner_up < brute[0][0] * (1 - 1e-9):  # a clear winner: the very same candidate
        label = (best.drafter, best.draft_placement) if best.drafter != "none" else ("none", None)
        assert (best.target, label, best.k) == brute[0][1:]
    # every ranked entry is its (drafter, target) pair's optimum over k
    for cand in result.ranked:
        label = (cand.drafter, cand.draft_placement) if cand.drafter != "none" else ("none", None)
        pair = [c[0] for c in brute if c[1] == cand.target and c[2] == label]
        assert cand.tokens_per_s == pytest.approx(max(pair), rel=1e-9)
    assert result.evaluated <= result.exhaustive


@settings(max_examples=100, deadline=None)
@given(problems(), st.data())
def test_failure_replan_is_the_brute_force_without_that_device(case, data):
    problem, raw_t, raw_d = case
    first = plan(problem)
    failed = data.draw(st.sampled_from(sorted(first.best.devices)))
    brute = brute_force(raw_t, raw_d, problem.k_max,
                        (problem.workload.prompt_tokens, problem.workload.new_tokens) if problem.workload else None,
                        failed={failed})
    if not brute:
        with pytest.raises(BackendError, match="device failures"):
            replan(first, failed=failed)
        return
    second = replan(first, failed=failed)
    assert failed not in second.best.devices
    assert second.best.tokens_per_s == pytest.approx(max(c[0] for c in brute), rel=1e-9)
    # the engine's shortcut, "take the next candidate not using the device", agrees
    fallback = next(c for c in first.ranked if failed not in c.devices)
    assert fallback.tokens_per_s == pytest.approx(second.best.tokens_per_s, rel=1e-12)


# ------------------------------------------------------------------ hand-made tables
def _profile(backend, device, precision, verify, decode=None, exact=True, prefill=((1, 1e-3), (128, 0.1))):
    verify = tuple(verify)
    return DeviceProfile("m", Placement(backend, device, precision), CostCurve(prefill),
                         decode or verify[0][1], CostCurve(verify), exact)


PROPORTIONAL = [(w, 0.5 * w) for w in range(1, 18)]  # verifying w tokens costs w decodes


def test_ties_break_to_smaller_k_then_kind_then_placement_name():
    # alpha = 1 and a verify proportional to its width: every k gives exactly 2 tokens/s
    targets = (_profile("torch", "cpu", "fp32", PROPORTIONAL), _profile("onnxruntime", "cpu", "fp32", PROPORTIONAL))
    drafter = DraftOption("ngram", 1.0)
    result = plan(Problem(targets, (drafter,), 8))
    assert {c.tokens_per_s for c in result.ranked} == {2.0}
    best = result.best
    assert (best.k, best.drafter, str(best.target)) == (0, "none", "onnxruntime:cpu/fp32")
    assert [str(c.target) for c in result.ranked[:2]] == ["onnxruntime:cpu/fp32", "torch:cpu/fp32"]
    # with k fixed, n-gram (kind order) beats an equally fast draft model
    free = _profile("fake", "fake:0", "fp32", [(1, 1e-9)])
    model = DraftOption("model", 1.0, DeviceProfile("d", free.placement, free.prefill, 1e-300, free.verify))
    fixed = plan(Problem(targets[:1], (model, drafter), 8, Constraints(k=3)))
    assert fixed.best.drafter == "ngram" and fixed.ranked[1].drafter == "model"
    assert fixed.ranked[0].tokens_per_s == fixed.ranked[1].tokens_per_s
    assert "a tie" in fixed.explain()


def _three_devices():
    fast = _profile("onnxruntime", "cpu", "int8", [(1, 0.010), (9, 0.014)])
    slow = _profile("torch", "cpu", "fp32", [(1, 0.030), (9, 0.040)])
    loose = _profile("openvino", "CPU", "ov-default", [(1, 0.005), (9, 0.006)], exact=False)
    draft = DraftOption("model", 0.95, _profile("openvino", "CPU", "int4", [(1, 0.001)]))
    return (fast, slow, loose), (DraftOption("ngram", 0.6, round_s=1e-5), draft)


def test_constraints_fixed_placements_exactness_and_failures():
    targets, drafters = _three_devices()
    free = plan(Problem(targets, drafters, 8))
    assert str(free.best.target) == "onnxruntime:cpu/int8"  # ov-default is not batch-invariant
    assert any("not batch-invariant" in why for _, why in free.excluded)
    assert str(plan(Problem(targets, drafters, 8, Constraints(exact_only=False))).best.target) \
        == "openvino:CPU/ov-default"
    pinned = plan(Problem(targets, drafters, 8, Constraints(target=Placement("torch", "auto", "auto"))))
    assert {str(c.target) for c in pinned.ranked} == {"torch:cpu/fp32"}
    ov = Constraints(target=Placement("openvino", "cpu", "auto"), exact_only=False)  # device case as backends
    assert str(plan(Problem(targets, drafters, 8, ov)).best.target) == "openvino:CPU/ov-default"
    assert matches(Placement("torch", "cuda", "fp16"), Placement("torch", "cuda:0", "fp16"))
    assert not matches(Placement("torch", "cuda", "fp16"), Placement("torch", "cuda:1", "fp16"))
    assert not matches(Placement("torch", "auto", "fp16"), Placement("torch", "cpu", "fp32"))
    only_ngram = plan(Problem(targets, drafters, 8, Constraints(drafter="ngram")))
    assert {c.drafter for c in only_ngram.ranked} <= {"ngram", "none"}
    k3 = plan(Problem(targets, drafters, 8, Constraints(k=3)))
    assert {c.k for c in k3.ranked} == {3}
    failed = plan(Problem(targets, drafters, 8, Constraints(failed=frozenset({"openvino:CPU"}))))
    assert all("openvino:CPU" not in c.devices for c in failed.ranked)
    with pytest.raises(ConfigError, match="config fixes the target"):
        plan(Problem(targets, drafters, 8, Constraints(target=Placement("cuda", "cuda:0", "fp16"))))
    with pytest.raises(ConfigError, match="k_max"):
        plan(Problem(targets, drafters, 4, Constraints(k=6)))


def test_failure_moves_the_role_and_runs_out_cleanly():
    targets, drafters = _three_devices()
    first = plan(Problem(targets, drafters, 8))
    assert first.best.draft_placement is not None  # the cheap int4 draft model pays
    second = replan(first, failed=first.best.draft_placement.device_key)
    assert second.best.target == first.best.target and second.best.drafter == "ngram"
    third = replan(second, failed="onnxruntime:cpu")
    assert str(third.best.target) == "torch:cpu/fp32"
    with pytest.raises(BackendError, match="no placement left after device failures"):
        replan(third, failed="torch:cpu")


def test_drift_replans_with_the_observed_acceptance():
    targets, drafters = _three_devices()
    first = plan(Problem(targets[:1], drafters[:1], 8))  # n-gram assumed at 0.6
    assert first.best.drafter == "ngram" and first.best.k > 0
    steady = AcceptanceTracker()
    for _ in range(50):  # 3 of 4 trials, then 0 of 1: 0.6 as assumed
        steady.observe(5, 3)
        steady.observe(5, 0)
    assert replan_if_drifted(first, steady) is None
    poor = AcceptanceTracker()
    for _ in range(50):
        poor.observe(5, 0)
    second = replan_if_drifted(first, poor)
    assert second is not None and second.best.k == 0 and second.best.drafter == "none"
    assert [d.alpha for d in second.problem.drafters] == [0.0]
    # once off, the drafter still measured on the side drifts back: speculation returns
    rich = AcceptanceTracker()
    for _ in range(50):
        rich.observe(5, 5)
    third = replan_if_drifted(second, rich)
    assert third is not None and third.best.drafter == "ngram" and third.best.k == 8


def test_explain_names_the_choice_and_the_reason():
    targets, drafters = _three_devices()
    result = plan(Problem(targets, drafters, 8, workload=Workload(100, 50)))
    text = result.explain()
    lines = text.splitlines()
    assert lines[0].startswith(f"plan: {result.best.drafter_label} k={result.best.k} drafting for "
                               f"{result.best.target}, predicted {result.best.tokens_per_s:.1f} tokens/s")
    table = [line for line in lines if line.lstrip().startswith(("1 ", "2 ", "3 ", "4 ", "5 ", "6 "))]
    assert len(table) == len(result.ranked)
    assert "why:" in text and "runner-up" in text and "excluded: target openvino:CPU/ov-default" in text
    assert "100 prompt + 50 new tokens" in text
    off = plan(Problem(targets[:1], (DraftOption("ngram", 0.05),), 8))
    assert off.explain().startswith("plan: target-only on onnxruntime:cpu/int8")
    assert "speculation does not pay" in off.explain()


def test_keep_target_moves_only_the_drafter_when_the_draft_device_fails():
    a = _profile("onnxruntime", "cpu", "int8", [(1, 0.010), (9, 0.014)])
    b = _profile("torch", "cpu", "fp32", [(1, 0.009), (3, 0.0095), (9, 0.030)])  # cheap only when short
    int4 = _profile("openvino", "CPU", "int4", [(1, 0.001)])
    first = plan(Problem((a, b), (DraftOption("ngram", 0.6), DraftOption("model", 0.95, int4)), 8))
    assert (str(first.best.target), first.best.drafter) == ("onnxruntime:cpu/int8", "model")
    moved = replan(first, failed="openvino:CPU")
    assert (str(moved.best.target), moved.best.drafter) == ("torch:cpu/fp32", "ngram")  # globally best
    kept = replan(first, failed="openvino:CPU", keep_target=True)
    assert (str(kept.best.target), kept.best.drafter) == ("onnxruntime:cpu/int8", "ngram")
    # the target's own device failing overrides the pin
    assert str(replan(first, failed="onnxruntime:cpu", keep_target=True).best.target) == "torch:cpu/fp32"


def test_plan_primes_an_adaptive_policy_with_its_costs():
    targets, drafters = _three_devices()
    result = plan(Problem(targets[:2], drafters, 8))
    cost = result.round_cost()
    assert cost.rate(result.best.alpha, result.best.k) == pytest.approx(result.best.decode_tokens_per_s)
    policy = result.adaptive_policy()
    assert policy.k_max == 8 and policy.alpha == pytest.approx(0.95)
    assert policy.next_k(100) == result.best.k  # with no observations it follows the plan
    off = plan(Problem(targets[:1], (DraftOption("ngram", 0.05),), 8))
    assert off.best.k == 0 and off.adaptive_policy().next_k(100) == 0  # starts off, may probe later
    assert plan(Problem(targets[:1], (), 8)).adaptive_policy() is None
