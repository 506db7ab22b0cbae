"""Drafter proxies for tests: wrap a real drafter and look at, or alter, its proposals."""
from __future__ import annotations

from hetero_sd.drafting.base import Drafter


class ProxyDrafter(Drafter):
    """Delegates begin/reset/draft to `inner`; subclasses override `seen(req, result)`."""

    def __init__(self, inner, name: str | None = None):
        self.inner, self.name = inner, name or inner.name

    def begin(self, capacity, sampler=None, guide=None):
        self.inner.begin(capacity, sampler, guide)

    def reset(self):
        self.inner.reset()

    def draft(self, req):
        return self.seen(req, self.inner.draft(req))

    def seen(self, req, result):
        return result
