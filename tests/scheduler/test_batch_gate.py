"""The speculation gate: per batch size, drafting on or off by measured tokens per second."""
from __future__ import annotations

import pytest

from hetero_sd.scheduler.batch_gate import SpeculationGate


def run(gate: SpeculationGate, batch: int, rate: dict[bool, float], steps: int) -> list[bool]:
    """Feed `steps` steps whose tokens per second are rate[drafted]; the choices made."""
    choices = []
    for _ in range(steps):
        on = gate.decide(batch)
        gate.observe(batch, on, tokens=round(rate[on] * 0.01), seconds=0.01)
        choices.append(on)
    return choices


def test_both_arms_first_then_the_faster():
    gate = SpeculationGate(min_steps=3, explore_every=5, explore_rarely=20)
    first = run(gate, 16, {True: 900.0, False: 1000.0}, 6)
    assert first == [True, False, True, False, True, False]  # each arm min_steps, drafting first
    later = run(gate, 16, {True: 900.0, False: 1000.0}, 100)
    assert later.count(True) == 20  # off wins by 11% (< clear_lead): on explored every 5th step
    assert gate.state()[16]["off"]["tok_s"] == pytest.approx(1000.0)


def test_a_clear_lead_explores_rarely_and_buckets_are_separate():
    gate = SpeculationGate(min_steps=2, explore_every=4, explore_rarely=25)
    run(gate, 1, {True: 1400.0, False: 1000.0}, 4)
    choices = run(gate, 1, {True: 1400.0, False: 1000.0}, 100)
    assert choices.count(False) == 4  # a 40% lead: the slower arm once per 25 steps
    # batch 9..16 is its own bucket: it starts over (both arms), unaffected by batch 1's verdict
    assert run(gate, 12, {True: 500.0, False: 1000.0}, 4) == [True, False, True, False]
    assert run(gate, 16, {True: 500.0, False: 1000.0}, 30).count(True) <= 2
    assert SpeculationGate.bucket(1) == 1 and SpeculationGate.bucket(3) == 4 and SpeculationGate.bucket(16) == 16
    assert SpeculationGate.bucket(17) == 32


def test_it_follows_a_change():
    """Drafting stops paying (the prompts turn open-ended): the exploring steps see it and the
    choice flips; the discount lets new evidence outweigh the old."""
    gate = SpeculationGate(min_steps=2, explore_every=4, explore_rarely=8, decay=0.9)
    run(gate, 8, {True: 2000.0, False: 1000.0}, 50)
    assert run(gate, 8, {True: 2000.0, False: 1000.0}, 8).count(True) >= 7
    after = run(gate, 8, {True: 600.0, False: 1000.0}, 120)
    assert after[-40:].count(True) <= 10


@pytest.mark.parametrize("kwargs", [{"min_steps": 0}, {"explore_every": 1}, {"explore_every": 9, "explore_rarely": 8},
                                    {"decay": 0.0}, {"decay": 1.5}])
def test_bad_settings(kwargs):
    with pytest.raises(ValueError):
        SpeculationGate(**kwargs)
