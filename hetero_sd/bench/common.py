"""What every bench run shares: the workload (prompts already tokenized, the
same ids for everyone), one measured generation, one run's results, and the
progress display.

Counting rules, the same for every run so figures compare:
- generated tokens are the ids returned, counted (never words or characters);
  an EOS a peer returns is dropped, as our engine never emits it;
- tok/s = new tokens / wall time of the whole call, prefill included;
- decode tok/s = (new tokens - 1) / (wall time - time to first token).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

from hetero_sd.bench.prompts import Prompt

EOS_POLICIES = {"ignore": "EOS ignored", "stop": "stopping at EOS"}  # policy -> how reports say it
WARMUP_PROMPT = "Name three colours of the rainbow."  # not in any prompt set: warms, never measured


class Skip(Exception):
    """A run cannot take place here (peer absent, model form unsupported); the reason is reported."""


@dataclass
class Workload:
    prompts: list[Prompt]
    ids: dict[str, list[int]]  # prompt id -> token ids (our tokenizer, chat template on)
    warmup_ids: list[int]
    max_new_tokens: int
    eos_policy: str  # "ignore": every run makes exactly max_new_tokens; "stop": stop at EOS
    eos_ids: tuple[int, ...]  # the target's EOS ids (used by every run when eos_policy == "stop")

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self.eos_ids if self.eos_policy == "stop" else ()

    def strip_eos(self, out: list[int]) -> tuple[list[int], str]:
        """A peer's output ids with a trailing EOS removed, and the finish reason."""
        if self.eos_policy == "stop" and out and out[-1] in self.eos_ids:
            return out[:-1], "eos"
        return out, "length"


@dataclass
class Sample:
    """One measured generation of one run on one prompt."""
    id: str
    kind: str
    prompt_tokens: int
    token_ids: list[int]
    total_s: float
    prefill_s: float  # time to the first new token
    finish: str = ""
    drafted: int | None = None  # None where the runtime does not report it
    accepted: int | None = None

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tok_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float | None:
        decode = self.total_s - self.prefill_s
        return (self.new_tokens - 1) / decode if self.new_tokens > 1 and decode > 0 else None

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    def to_dict(self) -> dict:
        return {"id": self.id, "kind": self.kind, "prompt_tokens": self.prompt_tokens,
                "new_tokens": self.new_tokens, "token_ids": self.token_ids, "total_s": self.total_s,
                "prefill_s": self.prefill_s, "tok_s": self.tok_s, "decode_tok_s": self.decode_tok_s,
                "drafted": self.drafted, "accepted": self.accepted, "acceptance": self.acceptance,
                "finish": self.finish}


@dataclass
class RunResult:
    name: str  # unique, short: "ours target-only", "genai-exact prompt-lookup", ...
    family: str  # "ours" | "genai" | "transformers"
    label: str  # one line saying what ran
    settings: dict = field(default_factory=dict)
    own_greedy: str | None = None  # the run holding this runtime's own plain greedy output
    lossless_settings: bool = True  # run with settings meant to be exact (GenAI defaults are not)
    load_s: float = 0.0
    samples: list[Sample] = field(default_factory=list)
    # The run this one's speedups divide by (None: the bench's baseline). Our speculative
    # runs each get a target-only run interleaved with them on the same engine, prompt by
    # prompt, so their ratio never compares generations made minutes apart on a noisy host.
    baseline: str | None = None
    hidden: bool = False  # a paired baseline: in the JSON results, not in the tables


class Progress:
    """One bar over every measured generation, plus log lines, on stderr."""

    def __init__(self, total: int, enabled: bool | None = None):
        from tqdm import tqdm

        # enabled=None: tqdm shows the bar only when stderr is a terminal.
        self._bar = tqdm(total=total, unit="gen", file=sys.stderr, disable=None if enabled is None else not enabled,
                         dynamic_ncols=True, leave=False)
        self._tqdm = tqdm

    def step(self, what: str) -> None:
        self._bar.set_postfix_str(what[-48:], refresh=False)
        self._bar.update(1)

    def skip(self, n: int) -> None:
        self._bar.total = max(self._bar.n, (self._bar.total or 0) - n)
        self._bar.refresh()

    def log(self, line: str) -> None:
        self._tqdm.write(line, file=sys.stderr)

    def close(self) -> None:
        self._bar.close()
