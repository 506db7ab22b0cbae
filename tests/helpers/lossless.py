"""What lossless tests share: a runner of a registered backend, and the check that a
speculative run's ids equal the target-only run's on the same engine."""
from __future__ import annotations

import pytest

from hetero_sd.backends.registry import discover
from hetero_sd.ir import load_model_ir

REGISTRY = discover()


def load_runner(backend: str, path, precision: str = "fp32", budget: int = 4 << 20):
    if backend not in REGISTRY.backends:
        pytest.fail(f"backend {backend} missing: install the test extra (pip install -e '.[test]')")
    return REGISTRY.get(backend).load(load_model_ir(path), "cpu", precision, budget)


def assert_lossless(engine, prompt, max_new: int, label: str):
    """Speculative ids equal target-only ids, and the result says exact; returns its stats."""
    base = engine.generate_ids(prompt, max_new, target_only=True)
    spec = engine.generate_ids(prompt, max_new)
    assert spec.token_ids == base.token_ids, f"{label}: diverged"
    assert spec.stats.lossless == "exact"
    return spec.stats


def greedy_ids(runner, prompt, n: int) -> list[int]:
    """The runner's own greedy decode, one token per call after the prefill."""
    seq = runner.allocate(len(prompt) + n)
    out = runner.greedy(seq, prompt, 0, 1)
    while len(out) < n:
        out += runner.greedy(seq, out[-1:], len(prompt) + len(out) - 1, 1)
    runner.release(seq)
    return out
