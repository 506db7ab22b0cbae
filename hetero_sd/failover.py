"""What the engine does when a device fails mid-generation.

A failing drafter costs speed, never output: the round's drafts are dropped
and the engine asks its fallback for the next drafter (or goes on with the
target alone). A failing target is replaced by the fallback's next target,
which replays the committed tokens into its own cache (the prompt as a
prefill, the generated tokens as one verify-shaped call, exactly as the
failed target had seen them), so a batch-invariant replacement continues
token-identically. With no replacement left, the request ends with a
GenerationError that carries every token already produced.
"""
from __future__ import annotations

from typing import Callable, Protocol

from hetero_sd.errors import ConfigError, GenerationError, KVBudgetError


class Fallback(Protocol):
    def next_drafter(self, failed, error: BaseException):
        """A replacement Drafter (already built), or None to go on without drafts."""

    def next_target(self, failed, error: BaseException):
        """A replacement Runner, or None when no other device can take the target."""


class NoFallback:
    """Explicit placements: drafts stop, the target has no replacement."""

    def next_drafter(self, failed, error):
        return None

    def next_target(self, failed, error):
        return None


class RankedFallback:
    """Replacements in order of preference, built only when needed. Each entry
    is (label, factory); a factory that itself fails is skipped, so a whole
    chain of dead devices ends in target-alone (drafts) or a clear error."""

    def __init__(self, drafters: list[tuple[str, Callable]] = (), targets: list[tuple[str, Callable]] = ()):
        self.drafters, self.targets = list(drafters), list(targets)
        self.log: list[str] = []

    def _next(self, queue):
        while queue:
            label, factory = queue.pop(0)
            try:
                made = factory()
            except Exception as exc:  # the next device may be dead too: keep going
                self.log.append(f"{label} unavailable: {type(exc).__name__}: {exc}")
                continue
            self.log.append(f"switched to {label}")
            return made
        return None

    def next_drafter(self, failed, error):
        return self._next(self.drafters)

    def next_target(self, failed, error):
        return self._next(self.targets)


def is_device_failure(exc: BaseException) -> bool:
    """Errors that mean "this device broke", as opposed to bad input or a
    request that cannot fit anywhere, which another device would not fix."""
    return isinstance(exc, Exception) and not isinstance(exc, (ConfigError, GenerationError, KVBudgetError))


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]
