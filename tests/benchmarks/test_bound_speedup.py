"""benchmarks/bound_speedup.py: the hindsight bound's dynamic programme against an explicit
enumeration of every sequence of rounds, the agreement runs, and a run end to end on the tiny
model where the draft model is the target itself (figures measured, never asserted)."""
from __future__ import annotations

import json
import random

import pytest

from helpers.benchmarks import load_benchmark

mod = load_benchmark("bound_speedup")


def _every_plan(n: int, lookup, model, verify, step) -> list[float]:
    """The cost of every sequence of rounds over positions 1..n-1: each round a plain step or
    j <= run drafts from one drafter (an explicit list, built forwards)."""
    plans, done = [(1, 0.0)], []
    while plans:
        p, cost = plans.pop()
        if p >= n:
            done.append(cost)
            continue
        plans.append((p + 1, cost + verify[1]))
        for runs, price in ((lookup, 0.0), (model, step)):
            for j in range(1, (runs[p] if runs is not None else 0) + 1):
                plans.append((p + j + 1, cost + verify[1 + j] + j * price))
    return done


@pytest.mark.parametrize("seed", range(12))
def test_the_bound_is_the_cheapest_plan(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 9)
    verify = {1: 1.0}
    for w in range(2, 18):  # any non-decreasing curve
        verify[w] = verify[w - 1] + rng.choice([0.0, 0.1, 0.3, 0.9])
    answer = [rng.randint(0, 2) for _ in range(n)]
    runs = [mod.agreement_runs([rng.choice([a, 3]) for a in answer], answer) for _ in range(2)]
    lookup, model = (None if rng.random() < 0.2 else runs[0]), runs[1]
    step = rng.choice([0.0, 0.2, 0.5])
    plans = _every_plan(n, lookup, model, verify, step)
    assert mod.cheapest(n, lookup, model, verify, step) == pytest.approx(min(plans))
    assert mod.cheapest(n, lookup, model, verify, step) <= (n - 1) * verify[1] + 1e-12  # never above decoding alone


def test_agreement_runs_count_a_greedy_draft_s_right_tokens_from_each_position():
    assert mod.agreement_runs([1, 2, 9, 4, 5], [1, 2, 3, 4, 5]) == [2, 1, 0, 2, 1]
    assert mod.agreement_runs([], []) == []


def test_lookup_runs_replay_a_drafter_teacher_forced():
    from hetero_sd.drafting.suffix import SuffixDrafter

    drafter = SuffixDrafter(max_depth=8)
    prompt, answer = [5, 6, 7, 8, 9, 1], [5, 6, 7, 8, 9, 2, 3]
    runs = mod.lookup_runs(drafter, prompt, answer)
    # position 0 is the prefill's token; from 1 the prompt's 6 7 8 9 is copied, as configured: a match
    # of m tokens earns m drafts (factor 1), and the copy ends where the answer turns to 2
    assert runs == [0, 1, 2, 2, 1, 0, 0]
    assert drafter.global_tree.order  # the answer joined the global tree, as an answer in use does


def _yaml(tmp_path, model, drafter: str):
    path = tmp_path / "bound.yaml"
    path.write_text(f"target: {{model: {model}, backend: torch, precision: fp32}}\ndrafter: {drafter}\n"
                    "memory: {kv_budget: 4MiB}\ngeneration: {max_new_tokens: 16, chat_template: true}\n")
    return path


def test_end_to_end_a_draft_identical_to_the_target_is_always_right(tiny_model_dir, tmp_path, capsys):
    model = tiny_model_dir("llama")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "g", "kind": "grounded", "prompt": "Repeat: red green blue red green"})
                       + "\n" + json.dumps({"id": "o", "kind": "open", "prompt": "Write about rain."}) + "\n")
    cfg = _yaml(tmp_path, model, f"{{kind: hybrid, hybrid_with: model, model: {model}, backend: torch, "
                                 "precision: fp32, k: 4, suffix_corpus: none}")
    out = tmp_path / "out"
    assert mod.main(["--config", str(cfg), "--prompts", str(prompts), "--max-new-tokens", "12", "--reps", "1",
                     "--out", str(out)]) == 0
    report = json.loads((out / "bound.json").read_text())
    for kind in ("grounded", "open"):
        # the draft model is the target: its greedy token is the answer's at every position
        assert report["first_draft_right"][kind]["model"] == 1.0
        cases = report["bounds"][kind]
        assert set(cases) == {"lookup alone", "model alone", "as measured", "free drafts", "free verify rows"}
        assert all(dec > 0 and full > 0 for dec, full in cases.values())
        assert cases["free drafts"][0] >= cases["as measured"][0] >= cases["model alone"][0] - 1e-9
    assert "| grounded | as measured |" in capsys.readouterr().out


def test_a_drafter_it_cannot_model_is_refused_by_name():
    from hetero_sd.errors import ConfigError

    with pytest.raises(ConfigError, match="bound_speedup: drafter object is not modelled"):
        mod.split_drafter(object())
