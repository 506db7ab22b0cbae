"""The waiting queue: priority first, FIFO within a priority, ageing against
starvation, a bound that says when to retry."""
from __future__ import annotations

import pytest

from hetero_sd.scheduler.admission import AdmissionQueue, QueueFull


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _drain(q):
    out = []
    while (x := q.pop()) is not None:
        out.append(x[0])
    return out


def test_priority_then_fifo():
    q = AdmissionQueue(10, ageing_s=1e9, clock=Clock())
    for name, prio in [("a", 0), ("b", 5), ("c", 0), ("d", 5), ("e", -1)]:
        q.push(name, prio)
    assert _drain(q) == ["b", "d", "a", "c", "e"]


def test_ageing_lets_a_low_priority_request_run_under_a_stream_of_high_ones():
    clock = Clock()
    q = AdmissionQueue(100, ageing_s=10.0, clock=clock)
    q.push("low", 0)
    served = []
    for step in range(40):  # every second a new priority-2 request arrives and one runs
        clock.t = float(step)
        q.push(f"high{step}", 2)
        served.append(q.pop()[0])
        if served[-1] == "low":
            break
    assert "low" in served, "the low-priority request starved"
    assert 15 <= served.index("low") <= 25  # after ~20 s: two priority levels' worth of waiting


def test_bound_and_retry_after():
    q = AdmissionQueue(2, clock=Clock())
    q.push("a")
    q.push("b")
    with pytest.raises(QueueFull) as full:
        q.push("c")
    assert full.value.retry_after >= 1 and "full" in str(full.value)
    assert len(q) == 2


def test_remove_and_push_front_keep_order():
    clock = Clock()
    q = AdmissionQueue(5, ageing_s=1e9, clock=clock)
    for name in "abc":
        q.push(name)
        clock.t += 1
    assert q.remove(lambda x: x == "b") == ["b"]
    item, prio, arrived = q.pop()
    assert item == "a"
    q.push_front(item, prio, arrived)  # not admitted after all: first again
    assert _drain(q) == ["a", "c"]
    with pytest.raises(ValueError):
        AdmissionQueue(0)
