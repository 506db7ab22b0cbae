"""A draft model whose tokenizer is not the target's (universal assisted generation).

The draft keeps its own token sequence for the text the target committed:
each round that text is re-tokenized into the draft's vocabulary and the
draft's cache kept up to the longest common prefix (as ModelDrafter keeps it).

- Greedy requests: the draft drafts greedily in its own vocabulary, and its
  text is re-tokenized into the target's, after a few committed tokens of
  look-behind so that a token merging across the boundary is seen. The target
  verifies those ids like any draft: its output is its own greedy output,
  whatever the draft proposed.
- Sampled requests: Token-Level Intersection (Timor et al., ICML 2025). The
  draft's distribution is restricted to the tokens both vocabularies spell
  with the same bytes and renormalised; a token is drawn from it and proposed
  as the target's id of those bytes, with q scattered into the target's
  vocabulary. Rejection sampling against that q keeps the target's
  distribution exactly (it holds for any q the proposal was drawn from; this
  one proposes only tokens the target has).
"""
from __future__ import annotations

import copy
import functools
import json
from typing import Protocol, Sequence

import numpy as np

from hetero_sd.backends.base import Runner
from hetero_sd.drafting.base import Drafter, round_of
from hetero_sd.drafting.model import CatchUpClock, DraftStop, greedy_prob, sync_cache
from hetero_sd.ir.errors import ConfigError, KVBudgetError
from hetero_sd.ir.work import DraftRequest, DraftResult
from hetero_sd.scheduler.round import Round
from hetero_sd.sampling import draw

LOOKBEHIND = 3  # committed target tokens re-tokenized with the draft's text


class TextCodec(Protocol):
    """What the drafter needs of one tokenizer."""

    pieces: Sequence[bytes | None]  # each id's bytes (None: no fixed bytes, never shared)

    def encode(self, text: str, start: bool = False) -> list[int]:
        """Ids of `text`; start: it opens a sequence (the tokenizer's BOS, where it adds one)."""

    def decode(self, ids: Sequence[int]) -> str: ...


class TokenizerCodec:
    """A TextCodec of a Hugging Face fast tokenizer (or ir.tokenizer.FastTokenizer)."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self.pieces = token_pieces(tokenizer)

    def encode(self, text: str, start: bool = False) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=start))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character standing for each byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def token_pieces(tokenizer) -> list[bytes | None]:
    """The bytes each id stands for: byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2)
    through its alphabet, SentencePiece-style pieces with ▁ as a space and <0xNN>
    byte tokens; added tokens (<|im_start|>, ...) by their text."""
    backend = tokenizer.backend_tokenizer
    spec = json.loads(backend.to_str())
    added = {t["id"]: t["content"].encode() for t in spec.get("added_tokens", [])}
    byte_level = "ByteLevel" in json.dumps(spec.get("decoder"))
    table = _byte_decoder()
    out: list[bytes | None] = []
    for i in range(backend.get_vocab_size(with_added_tokens=True)):
        if i in added:
            out.append(added[i])
            continue
        token = backend.id_to_token(i)
        if token is None:
            out.append(None)
        elif byte_level:
            out.append(bytes(table[c] for c in token) if all(c in table for c in token) else None)
        elif len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            out.append(bytes([int(token[3:5], 16)]))
        else:
            out.append(token.replace("\u2581", " ").encode())
    return out


class VocabBridge:
    """Two vocabularies over one text: re-tokenization both ways, and the
    intersection (draft id -> the target id of the same bytes)."""

    def __init__(self, target: TextCodec, draft: TextCodec, target_vocab: int, draft_vocab: int):
        self.target, self.draft, self.target_vocab = target, draft, target_vocab
        by_bytes: dict[bytes, int] = {}
        for tid, piece in enumerate(list(target.pieces)[:target_vocab]):
            if piece:
                by_bytes.setdefault(piece, tid)
        self.to_target = np.full(draft_vocab, -1, dtype=np.int64)
        for did, piece in enumerate(list(draft.pieces)[:draft_vocab]):
            if piece and piece in by_bytes:
                self.to_target[did] = by_bytes[piece]
        self.shared = self.to_target >= 0
        if not self.shared.any():
            raise ConfigError("the draft's and the target's vocabularies share no token: "
                              "no draft of one can be proposed in the other")

    def draft_context(self, target_ids: Sequence[int]) -> list[int]:
        """The draft's ids for the text of the target's ids."""
        return self.draft.encode(self.target.decode(target_ids), start=True)

    def target_continuation(self, target_ids: Sequence[int], draft_ids: Sequence[int]) -> list[int]:
        """The target's ids for the draft's text after `target_ids`: re-tokenized with
        the last committed tokens, kept where those come back unchanged."""
        text = self.draft.decode(draft_ids)
        tail = list(target_ids[-LOOKBEHIND:])
        ids = self.target.encode(self.target.decode(tail) + text)
        if ids[:len(tail)] == tail:
            return ids[len(tail):]
        return self.target.encode(text)  # the draft's text merges into a committed token

    def scatter(self, q: np.ndarray) -> np.ndarray:
        """A distribution over shared draft ids as one over the target's ids."""
        out = np.zeros(self.target_vocab, dtype=np.float64)
        np.add.at(out, self.to_target[self.shared], q[self.shared])
        return out


class CrossVocabDrafter(Drafter):
    """A draft model of another tokenizer, drafting for the target's ids."""

    name = "model"
    can_fork = True
    takes_guide = False  # the engine cuts drafts a grammar refuses

    def __init__(self, runner: Runner, bridge: VocabBridge, min_prob: float | None = 0.0):
        if runner.vocab_size != len(bridge.to_target):
            raise ConfigError(f"the draft model scores {runner.vocab_size} tokens but its tokenizer "
                              f"bridge covers {len(bridge.to_target)}")
        # greedy drafts stop where the draft's own probability of its token falls below
        # this: a verify row the target would likely refuse costs more than it brings
        self.runner, self.bridge, self.min_prob = runner, bridge, min_prob
        self._seq: int | None = None
        self._capacity = 0
        self._cached: list[int] = []  # draft ids whose KV the draft cache holds
        self._sampler = None

    def fork(self) -> "CrossVocabDrafter":
        clone = copy.copy(self)
        clone._seq = None
        clone.reset()
        return clone

    def reset(self) -> None:
        if self._seq is not None:
            self.runner.release(self._seq)
        self._seq, self._cached, self._sampler = None, [], None
        self.forget_context()

    def begin(self, capacity: int, sampler=None, guide=None) -> None:
        self.reset()
        # the draft's ids for a text may outnumber the target's: room for twice as
        # many where the budget has it (past its end the draft simply stops drafting)
        want = min(2 * capacity, self.runner.max_context)
        try:
            self._seq = self.runner.allocate(want)
        except KVBudgetError:
            want = min(capacity, self.runner.max_context)
            self._seq = self.runner.allocate(want)
        self._capacity, self._sampler = want, sampler

    def draft(self, req: DraftRequest, rnd: Round | None = None) -> DraftResult:
        rnd = round_of(rnd)
        if self._seq is None:
            raise RuntimeError("CrossVocabDrafter.begin must be called before draft")
        context = self.context_for(req)
        if req.k <= 0:  # (a hybrid's round for the other drafter: the next one re-tokenizes anyway)
            return DraftResult(req.seq_id, [], None)
        ids = self.bridge.draft_context(context)
        if not ids or len(ids) + req.k > self._capacity:
            return DraftResult(req.seq_id, [], None)
        feed = sync_cache(self.runner, self._seq, self._cached, ids)
        clock = CatchUpClock(len(feed))
        if self._sampler is None:
            drafted = self._greedy(feed, req.k, DraftStop(self.min_prob, rnd), clock)
            rnd.catch_up_s = clock.seconds
            return DraftResult(req.seq_id, self.bridge.target_continuation(context, drafted)[:req.k], None)
        tokens, probs = self._intersection(feed, req.k, clock)
        rnd.catch_up_s = clock.seconds
        return DraftResult(req.seq_id, tokens, np.stack(probs) if probs else None)

    def _greedy(self, feed: list[int], k: int, stop: DraftStop, clock: CatchUpClock) -> list[int]:
        """Up to k draft tokens, as far as the stop rule goes (model.DraftStop)."""
        out = []
        for i in range(k):
            token, prob = greedy_prob(self.runner, self._seq, feed, len(self._cached), stop.needs_prob)
            clock.first_call_done()
            self._cached.extend(feed)
            propose, go_on = stop.take(i, prob)
            if propose:
                out.append(token)
                feed = [token]
            if not go_on:
                break
        return out

    def _intersection(self, feed: list[int], k: int, clock: CatchUpClock) -> tuple[list[int], list[np.ndarray]]:
        tokens, probs = [], []
        for _ in range(k):
            logits = self.runner.forward(self._seq, feed, len(self._cached), 1)
            clock.first_call_done()
            q = self._sampler.probs(logits)[-1]
            if not np.isfinite(q).all():
                raise FloatingPointError(f"{self.name}: the draft model's distribution is not finite")
            proposal = self._propose(q)
            if proposal is None:
                break
            token, target_token, q_target = proposal
            self._cached.extend(feed)
            tokens.append(target_token)
            probs.append(q_target)
            feed = [token]
        return tokens, probs

    def _propose(self, q: np.ndarray) -> tuple[int, int, np.ndarray] | None:
        """Token-Level Intersection: a draft token drawn from q restricted to the shared
        tokens and renormalised, its target id, and that q over the target's ids;
        None when q puts no mass on a shared token."""
        restricted = np.where(self.bridge.shared, q, 0.0)
        mass = restricted.sum()
        if mass <= 0:
            return None
        restricted /= mass
        token = draw(restricted, self._sampler.draft_rng)
        return token, int(self.bridge.to_target[token]), self.bridge.scatter(restricted)
