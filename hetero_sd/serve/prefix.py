"""A prefix cache for the serving engine: finished requests' target sequences
are kept for their KV, and a new prompt that begins like one of them copies
that prefix instead of computing it (a shared system prompt, a conversation's
earlier turns, the same prompt asked again), as vLLM's automatic prefix
caching and llama.cpp's slots do.

Exact, not approximate: it is offered only on runners whose copy_prefix
promises that every row is row-invariant (onnxruntime), so the copied KV is
bitwise what the new request's own prefill would write; the last prompt token
is always computed, so its logits are the request's own. Bounded: at most
`max_entries` sequences, least recently used evicted first, and evicted on
demand when a new request needs the pool's room.

Partitioned by tenant: an entry is found only by a request of the tenant that
left it (an API key's digest, and a request's cache_salt), so one client can
never time or count its way into another's text through `cached_tokens`.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from hetero_sd.drafting.base import common_prefix


@dataclass
class Hit:
    seq: int
    length: int


class PrefixCache:
    def __init__(self, target, max_entries: int = 8, min_tokens: int = 16):
        self.target, self.max_entries, self.min_tokens = target, max_entries, min_tokens
        # seq -> (its tenant, the tokens its KV holds)
        self._entries: OrderedDict[int, tuple[str, list[int]]] = OrderedDict()
        self.hits = self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def held_tokens(self) -> int:
        """KV positions the kept sequences fill."""
        return sum(len(tokens) for _, tokens in list(self._entries.values()))

    def offer(self, seq: int, tokens: list[int], tenant: str = "") -> None:
        """Keep a finished request's sequence (the cache now owns it)."""
        if len(tokens) < self.min_tokens or self.max_entries < 1:
            self.target.release(seq)
            return
        self._entries[seq] = (tenant, tokens)
        while len(self._entries) > self.max_entries:
            self.evict()

    def find(self, prompt: list[int], tenant: str = "") -> Hit | None:
        """The tenant's cached sequence sharing the longest prefix with `prompt`, and how
        much of it to copy (never the prompt's last token: its logits are computed)."""
        best: Hit | None = None
        for seq, (owner, tokens) in self._entries.items():
            if owner != tenant:
                continue
            n = min(common_prefix(tokens, prompt), len(prompt) - 1)
            if n >= self.min_tokens and (best is None or n > best.length):
                best = Hit(seq, n)
        if best is not None:
            self._entries.move_to_end(best.seq)
            self.hits, self.reused_tokens = self.hits + 1, self.reused_tokens + best.length
        return best

    def evict(self) -> bool:
        """Release the least recently used sequence; False when there is none."""
        if not self._entries:
            return False
        seq, _ = self._entries.popitem(last=False)
        self.target.release(seq)
        return True

    def clear(self) -> None:
        while self.evict():
            pass
