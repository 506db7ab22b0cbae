"""How far ahead to draft: a policy fed with acceptance after each round."""
from __future__ import annotations

from dataclasses import dataclass

from hetero_sd.ir.work import MAX_DRAFT_TOKENS


@dataclass
class FixedDraftLength:
    """Always propose k tokens (bounded by what is left to generate)."""

    k: int

    def __post_init__(self):
        if not 1 <= self.k <= MAX_DRAFT_TOKENS:
            raise ValueError(f"k must be in 1..{MAX_DRAFT_TOKENS}, got {self.k}")

    def next_k(self, remaining: int) -> int:
        return max(0, min(self.k, remaining))

    def observe(self, drafted: int, accepted: int) -> None:
        """Fixed: acceptance does not change k (adaptive policies override this)."""
