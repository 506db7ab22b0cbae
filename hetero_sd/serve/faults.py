"""Injected faults, for tests and soaks only: make one request fail in one phase of
the batch engine, so per-request isolation is tested directly.

    plan = FaultPlan.load("plan.json")     # `hetero-sd serve --fault-plan plan.json`
    BatchEngine(engine, faults=plan)       # or batch.faults = plan, in process

A plan is a JSON list of rules: {"marker": "FAULT-A", "phase": "propose",
"error": "ValueError", "message": "injected"}. A request whose prompt text holds
the marker raises that error when the batch engine reaches that phase for it.
Nothing over HTTP can set or change a plan: it is given when the process starts.
"""
from __future__ import annotations

import builtins
import json
from dataclasses import dataclass
from pathlib import Path

from hetero_sd.errors import HeteroSDError

# "thread" fires outside every per-request guard: it kills the batch engine's thread, to
# test what clients and a supervisor see then (the others end their request alone)
PHASES = ("admit", "prefill", "propose", "score", "accept", "thread")
_ERRORS = ("ValueError", "RuntimeError", "KeyError", "MemoryError", "ZeroDivisionError", "AssertionError",
           "TypeError", "IndexError", "OSError")


@dataclass(frozen=True)
class Fault:
    marker: str
    phase: str
    error: str = "RuntimeError"
    message: str = "injected fault"

    def __post_init__(self):
        if self.phase not in PHASES:
            raise HeteroSDError(f"fault plan: phase {self.phase!r} is not one of {', '.join(PHASES)}")
        if self.error not in _ERRORS:
            raise HeteroSDError(f"fault plan: error {self.error!r} is not one of {', '.join(_ERRORS)}")
        if not self.marker:
            raise HeteroSDError("fault plan: a rule needs a non-empty marker")


class FaultPlan:
    def __init__(self, faults: list[Fault], decode):
        self.faults, self._decode = faults, decode  # decode: prompt ids -> text (the tokenizer's)

    @classmethod
    def load(cls, path: str | Path, decode) -> "FaultPlan":
        try:
            rules = json.loads(Path(path).read_text())
            return cls([Fault(**rule) for rule in rules], decode)
        except (OSError, ValueError, TypeError) as exc:
            raise HeteroSDError(f"{path}: not a fault plan (a JSON list of {{marker, phase, error, "
                                f"message}} rules): {exc}") from None

    def matching(self, prompt_ids: list[int]) -> dict[str, Fault]:
        """The rules a prompt triggers, by phase (read once per request)."""
        text = self._decode(prompt_ids)
        return {f.phase: f for f in self.faults if f.marker in text}


def fire(rules: dict[str, Fault] | None, phase: str) -> None:
    """Raise the injected error of `phase`, if the request has one."""
    fault = (rules or {}).get(phase)
    if fault is not None:
        raise getattr(builtins, fault.error)(f"{fault.message} ({phase})")
