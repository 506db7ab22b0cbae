"""What passes between a client and the batch engine: the Submission a client makes,
the Handle it holds (to cancel it), and the Events it is sent."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from hetero_sd.sampling import SamplingParams


@dataclass
class Submission:
    """What a client asks the server for (the engine's Request is made at admission)."""
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop: list[str] = field(default_factory=list)
    priority: float = 0.0
    speculate: bool = True  # False: target-only for this request
    constraint: object = None  # hetero_sd.constraint.Constraint (None: the engine's default, if any)
    logprobs: int | None = None  # each token's log-probability and this many alternatives (None: off)
    tenant: str = ""  # whose prefix-cache entries it may reuse (an API key's digest, a cache_salt)
    deadline_s: float | None = None  # seconds from submission; past it, finish_reason "timeout"


@dataclass
class Event:
    """What a request produced since its last event. The final event has
    finish_reason ("stop" | "length" | "eos" | "context" | "abort" | "cancelled"
    | "timeout" | "error"), the whole GenerationResult (None if the request never
    ran or its run could not be closed), and for "error" the message."""
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    result: object = None  # hetero_sd.request.GenerationResult on the final event
    error: str | None = None
    logprobs: list | None = None  # hetero_sd.scoring.TokenLogprob of token_ids, when asked for


class Handle:
    def __init__(self, request: Submission, on_event: Callable[[Event], None]):
        self.request, self.on_event = request, on_event
        self.cancelled = False
        self.submitted = time.monotonic()
        self.deadline = None if request.deadline_s is None else self.submitted + request.deadline_s
        self.first_token_at: float | None = None
        self.faults: dict | None = None  # injected faults by phase (serve/faults.py; tests only)

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now > self.deadline

    def cancel(self) -> None:
        """Free the request's sequence at the next step boundary (a client that left)."""
        self.cancelled = True
