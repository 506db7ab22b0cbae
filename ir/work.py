"""The work IR: flat records for the units of work the engine hands out.

The glossary, one for the whole code base (it follows vLLM's rejection
sampler; hetero_sd/sampling.py and the request object use these words):

    history    one request's tokens: the prompt, then every committed token, in
               order (TokenHistory). The request owns it, its stop checker
               appends to it, and in the engine's process nothing else keeps
               a copy: the failover wrapper and the drafters read it. A drafter
               in another process is sent deltas and rebuilds its own; a
               cascade stage extends a copy with its own provisional tokens.
    draft      a token a drafter proposes (DraftRequest -> DraftResult).
    step       one verify: the target scores the last committed token followed
               by the drafts, k + 1 rows in one call (VerifyRequest).
    accepted   the prefix of the drafts the target agrees with (greedy: equal
               to its own argmax; sampled: kept by rejection sampling).
    recovered  the target's own token at the first rejected position (greedy:
               its argmax there; sampled: drawn from norm(max(0, p - q))).
    bonus      the target's extra token after the last draft when every draft
               was accepted (drawn from, or the argmax of, p at that row).
    committed  accepted drafts plus the one recovered or bonus token: what a
               step appends to the history.
    rollback   the target's cache keeps the committed positions only, a length
               change (Runner.truncate), never a copy.

Every record has a fixed header of int32 fields plus at most one int32 token
array, so it packs to bytes with `struct` and can cross a process boundary in
shared memory without pickling. Fields marked wire=False stay in-process.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field, fields

MAX_DRAFT_TOKENS = 16  # upper bound on k; keeps verify records a fixed maximum size


class _Record:
    KIND = 0

    @classmethod
    def _wire_fields(cls):
        """Fields that cross a process boundary in the record itself; large
        tensors (metadata wire=False) travel through a shared arena instead."""
        return [f for f in fields(cls) if f.metadata.get("wire", True)]

    def pack(self) -> bytes:
        values = [getattr(self, f.name) for f in self._wire_fields()]
        ints, tokens = values[:-1], values[-1]
        return struct.pack(f"<{2 + len(ints)}i{len(tokens)}i", self.KIND, len(tokens), *ints, *tokens)

    @classmethod
    def unpack(cls, buf: bytes):
        n_ints = len(cls._wire_fields()) - 1
        kind, n_tok, *ints = struct.unpack_from(f"<{2 + n_ints}i", buf)
        if kind != cls.KIND:
            raise ValueError(f"record kind {kind} is not a {cls.__name__} ({cls.KIND})")
        tokens = list(struct.unpack_from(f"<{n_tok}i", buf, 4 * (2 + n_ints)))
        return cls(*ints, tokens)


class TokenHistory:
    """One request's tokens: the prompt, then each committed token (the glossary's
    history). Appended to by the request's stop checker alone; everyone else reads
    `ids` and never writes to it."""

    __slots__ = ("ids", "prompt_len")

    def __init__(self, prompt):
        self.ids: list[int] = list(prompt)
        self.prompt_len = len(self.ids)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def output(self) -> list[int]:
        """The committed tokens after the prompt (a copy)."""
        return self.ids[self.prompt_len:]

    @property
    def output_len(self) -> int:
        return len(self.ids) - self.prompt_len

    def output_since(self, n: int) -> list[int]:
        """The output tokens after the first n of them."""
        return self.ids[self.prompt_len + n:]

    def tail(self, n: int) -> list[int]:
        """The last n output tokens (fewer when there are fewer)."""
        return self.ids[max(self.prompt_len, len(self.ids) - n):]

    def append(self, token: int) -> None:
        self.ids.append(token)


@dataclass
class DraftRequest(_Record):
    """Propose up to k tokens. The drafter's view of the sequence is rolled back
    to `base_len` tokens, then `new_tokens` appended (the tokens committed since
    its last request; the whole prompt on the first): the delta a drafter in
    another process is sent. In process, `context` is the whole sequence after
    the delta (the request's history, or a cascade stage's own context), which a
    drafter reads instead of keeping a copy."""

    KIND = 1
    seq_id: int
    base_len: int
    k: int  # 1..MAX_DRAFT_TOKENS
    new_tokens: list[int] = field(default_factory=list)  # [n_new] int32
    # For a drafter that reads the target's hidden states (an EAGLE-style head):
    # float32 [n, F], row i the target's features at the position just before
    # new_tokens[-n + i] (so n = n_new, or n_new - 1 on the first request, whose
    # first token has nothing before it). None otherwise. In-process only: not packed.
    features: object = field(default=None, compare=False, repr=False, metadata={"wire": False})
    # Sequence[int], read-only: base_len + len(new_tokens) tokens, the context to
    # draft after. In-process only; a drafter sent only the delta rebuilds it (Drafter.context_for).
    context: object = field(default=None, compare=False, repr=False, metadata={"wire": False})


@dataclass(frozen=True)
class DraftPrices:
    """Costs in target decode steps, the time an accepted draft saves (about one step):
    rows[i], the verify row of draft i (0-based) beyond the rows before it,
    (V(i + 2) - V(i + 1)) / V(1); step, one draft step, D(1) / V(1).

    rate: the tokens speculation has lately made per decode step's time (>= 1, the
    rate of decoding alone). Time spent on a draft is worth what it would make at that
    rate, so a draft pays where its chance of acceptance covers rate x its costs
    (the ratio-maximising rule: Dinkelbach); at rate 1, the plain break-even."""

    rows: tuple[float, ...]
    step: float
    rate: float = 1.0


@dataclass
class DraftResult(_Record):
    KIND = 2
    seq_id: int
    tokens: list[int] = field(default_factory=list)  # [<=k] int32 proposed ids, may be empty
    # [len(tokens), vocab] float64 draft distributions q, sampling with a draft model only;
    # None for greedy or deterministic (n-gram) drafts. Not packed: it goes through the arena.
    probs: object = field(default=None, compare=False, repr=False, metadata={"wire": False})


@dataclass
class VerifyRequest(_Record):
    """One step (the glossary's): score `tokens` at positions [start, start+T),
    the last committed token followed by the drafts, so row i predicts the token
    after tokens[i]. A request's propose() returns it; score() or a batched
    forward scores it; accept() takes the scores."""

    KIND = 3
    seq_id: int
    start: int
    tokens: list[int] = field(default_factory=list)  # [1 + n_draft] int32
    # [n_draft, vocab] float64 draft distributions q when a sampled request drafted
    # with a model; None for greedy or deterministic drafts. In-process only.
    draft_probs: object = field(default=None, compare=False, repr=False, metadata={"wire": False})

    @property
    def drafts(self) -> list[int]:
        return self.tokens[1:]


# RunnerCall ops
ALLOCATE, FORWARD, GREEDY, TRUNCATE, RELEASE, LENGTH, FEATURES, COPY_PREFIX = range(1, 9)


@dataclass
class RunnerCall(_Record):
    """One call of a Runner that lives in another process (a Ray actor,
    hetero_sd/cluster). `start` is the committed length the call starts at
    (ALLOCATE: the capacity; TRUNCATE, COPY_PREFIX: the length), so a FORWARD
    or GREEDY executed twice rewrites the same positions and never commits
    twice. COPY_PREFIX copies seq_id's prefix into sequence `num_logits`."""

    KIND = 5
    op: int
    seq_id: int
    start: int
    num_logits: int
    tokens: list[int] = field(default_factory=list)  # [T] int32 (FORWARD, GREEDY)
