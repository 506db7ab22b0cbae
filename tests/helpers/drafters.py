"""Drafter proxies for tests: wrap a real drafter and look at, or alter, its proposals."""
from __future__ import annotations

import os
import signal

from hetero_sd.drafting.base import Drafter


class ProxyDrafter(Drafter):
    """Delegates begin/reset/draft to `inner`; subclasses override `seen(req, result)`."""

    def __init__(self, inner, name: str | None = None):
        self.inner, self.name = inner, name or inner.name

    def begin(self, capacity, sampler=None, guide=None):
        self.inner.begin(capacity, sampler, guide)

    def reset(self):
        self.inner.reset()

    def draft(self, req, rnd=None):
        return self.seen(req, self.inner.draft(req))

    def seen(self, req, result):
        return result


class KillAt(ProxyDrafter):
    """SIGKILLs the worker (its process, or a Ray actor's) from outside at a
    chosen draft call of the run: just before the request goes out, or just
    after its reply (an async worker is then drafting ahead). Counted in calls, so where it lands is not a matter
    of this machine's speed."""

    def __init__(self, inner, call: int, after_reply: bool):
        super().__init__(inner)
        self.call, self.after_reply, self.calls = call, after_reply, 0

    def draft(self, req, rnd=None):
        self.calls += 1
        kill = self.calls == self.call and self.inner.pid is not None
        if kill and not self.after_reply:
            os.kill(self.inner.pid, signal.SIGKILL)
        result = self.inner.draft(req)
        if kill and self.after_reply:
            os.kill(self.inner.pid, signal.SIGKILL)
        return result


def kill_at_random_points(target, drafter, runs: int, seed: int, after_run=lambda: None,
                          overlap: str = "auto") -> None:
    """`runs` generations on `target` with `drafter`'s worker SIGKILLed at a random
    draft call each (before the request, or after the reply, alternately): every
    output must equal the undisturbed run and report the failure in stats.events.
    overlap: scheduler.overlap (on: pre-drafts during verifies are among the calls)."""
    import random

    from hetero_sd.engine import Engine
    from helpers.tiny_models import random_prompt

    prompt, new = random_prompt(10, seed=21), 40
    counter = KillAt(drafter, 0, after_reply=False)  # kills nothing: counts the run's draft calls
    want = Engine(target, counter, k=3, overlap=overlap).generate_ids(prompt, new).token_ids
    assert want == Engine(target, None).generate_ids(prompt, new, target_only=True).token_ids
    assert counter.calls > 2
    rng = random.Random(seed)
    for run in range(runs):  # a later draft call always follows, and sees the death
        killer = KillAt(drafter, rng.randrange(1, counter.calls), after_reply=run % 2 == 1)
        got = Engine(target, killer, k=3, overlap=overlap).generate_ids(prompt, new)
        assert got.token_ids == want, f"run {run}: output changed after the worker was killed"
        assert any("failed" in e for e in got.stats.events), (run, got.stats.events)
        after_run()
