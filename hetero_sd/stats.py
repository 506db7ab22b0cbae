"""Per-request statistics: what a user needs to judge a speculative run."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from hetero_sd.scheduler.acceptance import count_positions


@dataclass
class GenerationStats:
    mode: str  # "target-only" | "ngram" | "model"
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt positions whose KV was reused from an earlier request (serving)
    new_tokens: int = 0
    rounds: int = 0  # target calls after prefill (one per verify)
    drafted: int = 0
    accepted: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    finish_reason: str = ""  # "eos" | "length" | "stop" | "grammar" | "context"
    lossless: str = "exact"  # "exact" or "up to numerics" (target not batch-invariant)
    events: list[str] = field(default_factory=list)  # device failures and what took over
    sampling: str = "greedy"  # or "T=.. top_k=.. top_p=.. seed=.." (exact = distribution-preserving)
    constraint: str = ""  # the grammar output was held to ("" = none); finish_reason "grammar" = it ended
    mask_s: float = 0.0  # all grammar work (masks on a helper thread overlap the target's forward)
    mask_wait_s: float = 0.0  # what of it sat on the critical path (inside verify_s and prefill_s)
    grammar_cut: int = 0  # drafts dropped because the grammar refused them
    grammar_drafted: int = 0  # drafts the grammar forced (added after a drafter's proposal)
    # drafting during verifies (scheduler/overlap.py): pre-drafts' seconds, the part of them the
    # device was still verifying through, and rounds whose drafts a pre-draft gave (draft_s: the rest)
    predraft_s: float = 0.0
    hidden_draft_s: float = 0.0
    predraft_hits: int = 0
    # per draft position i (0-based): rounds that drafted it, and rounds that accepted it
    drafted_pos: list[int] = field(default_factory=list)
    accepted_pos: list[int] = field(default_factory=list)

    def count_positions(self, drafted: int, accepted: int) -> None:
        count_positions(self.drafted_pos, self.accepted_pos, drafted, accepted)

    @property
    def other_s(self) -> float:
        return max(0.0, self.total_s - self.prefill_s - self.draft_s - self.verify_s)

    @property
    def hidden_share(self) -> float:
        """Of all drafting seconds (serial and pre-drafts), the share a verify hid."""
        total = self.draft_s + self.predraft_s
        return self.hidden_draft_s / total if total > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        """Accepted draft tokens per verify round."""
        return self.accepted / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_round(self) -> float:
        """Committed tokens per target call (accepted + bonus)."""
        return self.mean_accepted + 1.0 if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        decode = self.total_s - self.prefill_s
        return (self.new_tokens - 1) / decode if decode > 0 and self.new_tokens > 1 else 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        for name in ("other_s", "hidden_share", "acceptance_rate", "mean_accepted", "tokens_per_round",
                     "tokens_per_s", "decode_tokens_per_s"):
            out[name] = getattr(self, name)
        return out

    def summary(self) -> str:
        line = (f"{self.new_tokens} tokens in {self.total_s:.2f}s ({self.tokens_per_s:.1f} tok/s, "
                f"decode {self.decode_tokens_per_s:.1f} tok/s) | {self.mode}")
        if self.mode != "target-only":
            line += (f" | acceptance {self.acceptance_rate:.0%} | mean accepted "
                     f"{self.mean_accepted:.2f}/round over {self.rounds} rounds")
        line += (f" | prefill {self.prefill_s:.2f}s draft {self.draft_s:.2f}s verify {self.verify_s:.2f}s "
                 f"other {self.other_s:.2f}s | finish: {self.finish_reason}")
        if self.predraft_s:
            line += (f" | overlap: {self.hidden_share:.0%} of drafting hidden, {self.predraft_hits} rounds "
                     "pre-drafted")
        if self.events:
            line += f" | {len(self.events)} failover events (see stats.events)"
        if self.sampling != "greedy":
            line += f" | sampling {self.sampling}"
        if self.constraint:
            line += (f" | constraint {self.constraint}: grammar {self.mask_s * 1e3:.0f} ms "
                     f"({self.mask_wait_s * 1e3:.0f} ms on the critical path), {self.grammar_cut} drafts cut, "
                     f"{self.grammar_drafted} forced drafts")
        if self.lossless != "exact":
            line += f" | lossless {self.lossless}"
        return line
