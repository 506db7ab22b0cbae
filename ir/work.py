"""The work IR: flat records for the units of work the engine hands out.

Glossary (follows vLLM's rejection sampler): *draft* tokens are proposed by a
drafter; *accepted* tokens are the draft prefix the target agrees with; the
*bonus* token is the target's own next token after the accepted prefix (a
correction when a draft was rejected, a free extra token when all were kept).

Every record has a fixed header of int32 fields plus at most one int32 token
array, so it packs to bytes with `struct` and can cross a process boundary in
shared memory without pickling.
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


@dataclass
class DraftRequest(_Record):
    """Propose up to k tokens. The drafter first rolls its view of the sequence
    back to `base_len` committed tokens, then appends `new_tokens` (the tokens
    committed since its last request; the whole prompt on the first)."""

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
    """Score `tokens` at positions [start, start+T): the last committed token
    followed by the drafts, so row i predicts the token after tokens[i]."""

    KIND = 3
    seq_id: int
    start: int
    tokens: list[int] = field(default_factory=list)  # [1 + n_draft] int32


@dataclass
class VerifyResult(_Record):
    KIND = 4
    seq_id: int
    accepted: int  # number of draft tokens kept, 0..n_draft
    tokens: list[int] = field(default_factory=list)  # [accepted + 1] committed ids: accepted + bonus


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
