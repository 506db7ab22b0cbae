"""A failure stays with its request (hetero_sd/serve/batch.py): an error injected into one
request's admission, prefill, propose, scoring or accept ends that request alone, naming
the cause, while seven others running beside it finish exactly as they would alone. If
the engine's thread dies anyway, every request hears so at once and nothing more is
admitted. Deadlines end a request with "timeout", keeping its output; the prefix cache
keeps tenants apart; slow work runs outside the lock `submit` takes."""
from __future__ import annotations

import threading
import time

import pytest

from hetero_sd.serve.batch import BatchEngine, EngineDown, Submission
from hetero_sd.serve.faults import Fault, FaultPlan
from helpers.tiny_models import random_prompt
from serve.test_batch import _Collector, _engine

MARK = 7  # a prompt starting with this id carries the fault (the plan reads ids, not text, here)


def _plan(*faults: Fault) -> FaultPlan:
    return FaultPlan(list(faults), lambda ids: "FAULT" if ids[0] == MARK else "")


def _slowed(batch: BatchEngine, seconds: float = 0.02) -> BatchEngine:
    """Every batched call takes at least `seconds`, so a request is still running when asked."""
    real = batch.target.forward_batch
    batch.target.forward_batch = lambda items: (time.sleep(seconds), real(items))[1]
    return batch


def _run(batch: BatchEngine, prompts, max_new=12, **sub) -> list[_Collector]:
    collectors = [_Collector() for _ in prompts]
    for prompt, c in zip(prompts, collectors):
        batch.submit(Submission(prompt, max_new, **sub), c)
    for c in collectors:
        assert c.done.wait(120), "a request never ended"
    return collectors


@pytest.mark.parametrize("phase,error", [("admit", "ValueError"), ("prefill", "MemoryError"),
                                         ("propose", "RuntimeError"), ("score", "IndexError"),
                                         ("accept", "ZeroDivisionError")])
def test_one_failure_among_eight_ends_only_its_request(tiny_model_dir, phase, error):
    engine = _engine(tiny_model_dir("llama"))
    prompts = [random_prompt(12, seed=40 + i) for i in range(8)]
    prompts[3] = [MARK] + prompts[3][1:]
    solo = [engine.generate_ids(p, 12, target_only=True).token_ids for p in prompts]
    batch = BatchEngine(engine, max_running=8, prefills_per_step=8,
                        faults=_plan(Fault("FAULT", phase, error, "boom"))).start()
    try:
        done = _run(batch, prompts)
    finally:
        batch.shutdown()
    failed = done[3].events[-1]
    assert failed.finish_reason == "error" and f"{error}: boom ({phase})" in failed.error
    for i, c in enumerate(done):
        if i != 3:
            assert c.events[-1].finish_reason != "error" and c.result.token_ids == solo[i], i
    assert batch.failure is None and engine.target.usage().sequences == 0


def test_a_dead_thread_fails_everyone_fast(tiny_model_dir):
    """The "thread" fault escapes every per-request guard, as a bug of ours would."""
    engine = _engine(tiny_model_dir("llama"))
    died = []
    batch = _slowed(BatchEngine(engine, max_running=2, faults=_plan(Fault("FAULT", "thread", "ValueError", "bug")),
                                on_death=died.append)).start()
    try:
        running = _Collector()
        batch.submit(Submission(random_prompt(8, seed=1), 200), running)
        while not running.events:  # it runs before the fault arrives
            time.sleep(0.01)
        killer = _Collector()
        batch.submit(Submission([MARK] + random_prompt(8, seed=2), 8), killer)
        assert running.done.wait(60) and killer.done.wait(60)
        assert running.events[-1].finish_reason == "error" and "ValueError: bug" in running.events[-1].error
        assert killer.events[-1].finish_reason == "error"
        assert running.result is not None and running.result.token_ids  # what it made is kept
        assert died and "ValueError: bug" in batch.failure
        with pytest.raises(EngineDown, match="stopped"):
            batch.submit(Submission(random_prompt(8, seed=3), 4), _Collector())
    finally:
        batch.shutdown()


def test_a_deadline_ends_with_timeout_and_keeps_the_output(tiny_model_dir):
    engine = _engine(tiny_model_dir("llama"), drafter=False)
    batch = _slowed(BatchEngine(engine, max_running=1)).start()
    try:
        slow, queued = _Collector(), _Collector()
        batch.submit(Submission(random_prompt(8, seed=5), 200, deadline_s=0.4), slow)
        batch.submit(Submission(random_prompt(8, seed=6), 4, deadline_s=0.2), queued)  # waits behind it
        assert slow.done.wait(60) and queued.done.wait(60)
    finally:
        batch.shutdown()
    assert slow.events[-1].finish_reason == "timeout" and slow.result.stats.finish_reason == "timeout"
    produced = [t for e in slow.events for t in e.token_ids]
    assert 0 < len(produced) < 200 and produced == slow.result.token_ids
    assert queued.events[-1].finish_reason == "timeout" and queued.result is None


def test_the_prefix_cache_keeps_tenants_apart(tiny_model_dir):
    engine = _engine(tiny_model_dir("llama"), "onnxruntime", "fp32")
    prompt = random_prompt(40, seed=900)
    batch = BatchEngine(engine, max_running=2, prefix_cache=8).start()
    try:
        cached = [_run(batch, [prompt], tenant=t)[0].result.stats.cached_tokens
                  for t in ("alice/", "bob/", "alice/", "alice/salt", "bob/")]
    finally:
        batch.shutdown()
    # bob's first ask, and alice's salted one, find nothing of alice's
    assert cached[0] == 0 and cached[1] == 0 and cached[2] >= 39 and cached[3] == 0 and cached[4] >= 39, cached


def test_a_slow_admission_does_not_hold_the_lock(tiny_model_dir):
    """A grammar compile (or a drafter's fork) at admission takes seconds: submit and
    counts (what /metrics reads) must not wait for it."""
    engine = _engine(tiny_model_dir("llama"))
    batch = BatchEngine(engine, max_running=2).start()
    entered, release, order = threading.Event(), threading.Event(), []
    real = batch._new_live

    def slow(handle):
        entered.set()
        release.wait(30)  # (a breaker: under the lock, submit would wait this out and the order show it)
        order.append("admitted")
        return real(handle)

    batch._new_live = slow
    try:
        first = _Collector()
        batch.submit(Submission(random_prompt(8, seed=7), 4), first)
        assert entered.wait(30)
        batch.counts()
        batch.submit(Submission(random_prompt(8, seed=8), 4), _Collector())
        order.append("submitted")
        release.set()
        assert first.done.wait(60)
    finally:
        release.set()
        batch.shutdown()
    assert order[0] == "submitted", order
