"""The cost model: expected tokens per round, cost curves, the branch-and-bound k search."""
from __future__ import annotations

import ast
import math
import random
from pathlib import Path

import pytest

from hetero_sd.scheduler.cost_model import (CostCurve, DeviceProfile, DraftOption, Placement, RoundCost, Workload,
                                            expected_tokens, tokens_per_round)

SCHEDULER_DIR = Path(__file__).resolve().parents[2] / "scheduler"


def test_expected_tokens_per_position():
    # draft 1 accepted half the time; after it, every draft is
    assert expected_tokens((0.5, 1.0), 0) == 1.0
    assert expected_tokens((0.5, 1.0), 1) == pytest.approx(1.5)
    assert expected_tokens((0.5, 1.0), 3) == pytest.approx(1 + 0.5 + 0.5 + 0.5)  # the last value repeats
    for k in range(6):  # equal positions are the geometric model
        assert expected_tokens((0.7,) * 6, k) == pytest.approx(expected_tokens(0.7, k), rel=1e-12)
    with pytest.raises(ValueError):
        expected_tokens((0.5, 1.2), 2)
    with pytest.raises(ValueError):
        expected_tokens((), 2)


def test_expected_tokens_is_the_truncated_geometric_sum():
    for alpha in (0.0, 0.1, 0.5, 0.83, 0.99):
        for k in range(0, 17):
            assert expected_tokens(alpha, k) == pytest.approx(sum(alpha ** i for i in range(k + 1)), rel=1e-12)
    assert expected_tokens(1.0, 5) == 6.0  # every draft accepted, plus the bonus
    assert expected_tokens(0.0, 5) == 1.0  # only the bonus
    assert tokens_per_round(0.9, 0) == 1.0  # k = 0 is one target decode


def test_expected_tokens_matches_a_simulated_round():
    rng = random.Random(7)
    alpha, k, rounds = 0.7, 5, 40_000
    total = 0
    for _ in range(rounds):
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        total += accepted + 1  # the bonus token
    assert total / rounds == pytest.approx(expected_tokens(alpha, k), rel=0.02)


def test_hit_rate_mixes_in_rounds_that_commit_only_the_bonus():
    assert tokens_per_round(0.5, 3, hit=0.25) == pytest.approx(0.25 * expected_tokens(0.5, 3) + 0.75)


@pytest.mark.parametrize("bad", [(-0.1, 2), (1.1, 2), (0.5, -1)])
def test_expected_tokens_rejects_out_of_range(bad):
    with pytest.raises(ValueError):
        expected_tokens(*bad)


def test_cost_curve_interpolates_and_extrapolates():
    c = CostCurve(((1, 1.0), (3, 2.0), (5, 2.5)))
    assert c(1) == 1.0 and c(2) == 1.5 and c(3) == 2.0 and c(4) == 2.25 and c(5) == 2.5
    assert c(7) == pytest.approx(3.0)  # the last slope continues
    assert CostCurve(((4, 2.0),))(1) == 2.0 and CostCurve(((4, 2.0),))(9) == 2.0
    assert CostCurve(((2, 2.0), (4, 3.0)))(1) == 2.0  # never cheaper than the smallest call measured
    # noise made the last point cheaper: extrapolation stays flat, never decreasing
    assert CostCurve(((1, 2.0), (2, 1.5)))(10) == 1.5
    assert CostCurve.affine(0.5, 0.25)(4) == pytest.approx(1.5)


@pytest.mark.parametrize("points", [(), ((0, 1.0),), ((2, 1.0), (2, 2.0)), ((3, 1.0), (2, 2.0)),
                                    ((1, -1.0),), ((1, math.nan),)])
def test_cost_curve_rejects_bad_points(points):
    with pytest.raises(ValueError):
        CostCurve(points)


def test_min_from_bounds_every_later_size():
    rng = random.Random(3)
    for _ in range(200):
        sizes = sorted(rng.sample(range(1, 20), rng.randint(1, 6)))
        curve = CostCurve(tuple((n, rng.uniform(0.1, 3.0)) for n in sizes))
        for n in range(1, 24):
            exact = min(curve(m) for m in range(n, 40))
            assert curve.min_from(n) <= exact
            if n >= sizes[0]:
                assert curve.min_from(n) == pytest.approx(exact)  # tight on the measured range


def _random_cost(rng: random.Random, k_max: int) -> RoundCost:
    widths = sorted({1} | set(rng.sample(range(2, k_max + 2), rng.randint(0, k_max))))
    verify = CostCurve(tuple((w, rng.uniform(0.5, 5.0)) for w in widths))  # not even monotone
    draft = CostCurve.affine(rng.choice([0.0, rng.uniform(0, 0.3)]), rng.choice([0.0, rng.uniform(0, 1.0)]))
    return RoundCost(verify, draft)


def test_best_k_equals_trying_every_k_and_prunes():
    rng = random.Random(11)
    evaluated = tried = 0
    for _ in range(3000):
        k_max = rng.randint(1, 16)
        cost = _random_cost(rng, k_max)
        alpha, hit = rng.choice([0.0, 1.0, rng.random()]), rng.choice([1.0, rng.random()])
        rates = [cost.rate(alpha, k, hit) for k in range(k_max + 1)]
        k, rate, n = cost.best_k(alpha, k_max, hit)
        assert rate == max(rates) and k == rates.index(max(rates))  # first maximum: ties to smaller k
        evaluated, tried = evaluated + n, tried + k_max + 1
    assert evaluated < 0.8 * tried  # the bound does cut the search


def test_best_k_with_k_min():
    cost = RoundCost(CostCurve(((1, 1.0), (2, 3.0))))  # verifying is expensive: k = 0 wins
    assert cost.best_k(0.5, 8)[0] == 0
    k, rate, _ = cost.best_k(0.5, 8, k_min=1)
    assert k == 1 and rate == cost.rate(0.5, 1)


def test_round_seconds_pays_the_lookup_on_a_miss():
    cost = RoundCost(CostCurve(((1, 1.0), (5, 2.0))), CostCurve.affine(0.1, 0.0))
    assert cost.seconds(0) == 1.0
    assert cost.seconds(4, hit=0.5) == pytest.approx(0.1 + 0.5 * 2.0 + 0.5 * 1.0)


def test_draft_option_and_workload():
    prof = DeviceProfile("m", Placement("torch", "cpu", "fp32"), CostCurve(((8, 0.08), (32, 0.2))), 0.01,
                         CostCurve(((1, 0.01), (5, 0.014))))
    model = DraftOption("model", 0.7, prof, round_s=0.001)
    assert model.draft_curve()(3) == pytest.approx(0.031)
    assert model.prefill_s(16) == pytest.approx(0.12) and str(model) == "model@torch:cpu/fp32"
    ngram = DraftOption("ngram", 0.5, round_s=2e-5)
    assert ngram.draft_curve()(1) == ngram.draft_curve()(9) == 2e-5 and ngram.prefill_s(100) == 0.0
    with pytest.raises(ValueError):
        DraftOption("ngram", 0.5, prof)
    with pytest.raises(ValueError):
        DraftOption("model", 0.5)
    with pytest.raises(ValueError):
        DeviceProfile("m", prof.placement, prof.prefill, 0.0, prof.verify)
    assert Workload(10, 100).tokens_per_s(50.0, 1.0) == pytest.approx(100 / 3.0)


def test_placement_round_trips_through_text():
    p = Placement("openvino", "CPU", "int4")
    assert Placement.parse(str(p)) == p and p.device_key == "openvino:CPU"
    with pytest.raises(ValueError, match="torch:cpu/fp32"):
        Placement.parse("torch-cpu")


def test_scheduler_never_imports_tensor_libraries_or_backends():
    """The scheduler reasons over numbers (the layering in docs/architecture.md): no torch, numpy or backend import in its files."""
    banned = ("torch", "numpy", "hetero_sd.backends", "onnxruntime", "openvino")
    for path in sorted(SCHEDULER_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert not name.startswith(banned), f"{path.name} imports {name}"
