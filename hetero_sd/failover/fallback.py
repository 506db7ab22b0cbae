"""Fallbacks and re-planners: who replaces a failed device (the package docstring)."""
from __future__ import annotations

from typing import Callable, Protocol

from hetero_sd.backends.base import Runner
from hetero_sd.drafting.base import Drafter
from hetero_sd.errors import ConfigError, GenerationError, KVBudgetError, describe


class Fallback(Protocol):
    def next_drafter(self, failed, error: BaseException) -> Drafter | None:
        """A replacement Drafter (already built), or None to go on without drafts."""

    def next_target(self, failed, error: BaseException):
        """A replacement Runner, or None when no other device can take the target."""


class Replanner(Protocol):
    def on_round(self, drafted: int, accepted: int) -> Drafter | None:
        """Fed every speculative round; a new drafter when the plan changed, else None."""


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
                self.log.append(f"{label} unavailable: {describe(exc)}")
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


def where(runner: Runner) -> str:
    at = f"{runner.device.backend}:{runner.device.device}"
    return f"{at} on {runner.location}" if runner.location else at  # (another machine: cluster.RayRunner)


def _close(runner: Runner) -> None:
    """Free what a failed runner still holds elsewhere (a Ray actor still alive after a
    transient error)."""
    try:
        runner.close()
    except Exception:
        pass
