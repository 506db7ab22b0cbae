"""The engine: the speculative loop and the public `Engine` API.

One round: the drafter proposes k tokens; the target scores the last
committed token plus the drafts in one call (k+1 positions); the longest
prefix of drafts equal to the target's own greedy choices is accepted, and
the target's next token after it (the bonus) is committed too. Both caches
then roll back to the committed length, which is a length change in each
backend's pool. Target-only decoding is the same loop with no drafts, so the
two share every line that could make them differ.

With temperature > 0 the round is the same except for acceptance: modified
rejection sampling (hetero_sd/sampling.py) replaces the greedy comparison, so
committed tokens follow the target's distribution exactly.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

from hetero_sd.backends.base import Runner
from hetero_sd.drafters import Drafter
from hetero_sd.errors import GenerationError
from hetero_sd.ir.work import MAX_DRAFT_TOKENS, DraftRequest, VerifyRequest, VerifyResult
from hetero_sd.sampling import Sampler, SamplingParams
from hetero_sd.scheduler import FixedDraftLength
from hetero_sd.stats import GenerationStats
from hetero_sd.stopping import StopChecker


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: GenerationStats

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "stats": self.stats.to_dict()}


def accept_greedy(req: VerifyRequest, target_ids: list[int]) -> VerifyResult:
    """target_ids[i] is the target's choice after req.tokens[i]; keep drafts while they agree."""
    drafts = req.tokens[1:]
    a = 0
    while a < len(drafts) and drafts[a] == target_ids[a]:
        a += 1
    return VerifyResult(req.seq_id, a, drafts[:a] + [target_ids[a]])


class Engine:
    def __init__(self, target: Runner, drafter: Drafter | None = None, k: int = 5,
                 tokenizer=None, eos_ids: tuple[int, ...] = (), max_new_tokens: int = 128,
                 stop: tuple[str, ...] = (), chat_template: bool = False,
                 sampling: SamplingParams = SamplingParams()):
        self.target, self.drafter, self.tokenizer = target, drafter, tokenizer
        self.sampling = sampling  # the default for requests that do not pass their own
        self.policy = FixedDraftLength(k)
        self.eos_ids = set(eos_ids)
        self.max_new_tokens, self.stop, self.chat_template = max_new_tokens, list(stop), chat_template

    @classmethod
    def from_config(cls, path: str | Path | None = None, progress: bool = False, **overrides) -> "Engine":
        """Build from a YAML file (None: the packaged default, configs/cpu.yaml)."""
        from hetero_sd.builder import build_engine
        from hetero_sd.config import load_config

        return build_engine(load_config(path, overrides), progress=progress)

    # ------------------------------------------------------------ text API
    def encode(self, prompt: str, chat_template: bool | None = None) -> list[int]:
        if self.tokenizer is None:
            raise GenerationError("this engine has no tokenizer; use generate_ids")
        use_chat = self.chat_template if chat_template is None else chat_template
        if use_chat and getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        return list(self.tokenizer(prompt)["input_ids"])

    def generate(self, prompt: str, max_new_tokens: int | None = None, target_only: bool = False,
                 stop: list[str] | None = None, chat_template: bool | None = None,
                 sampling: SamplingParams | None = None, **sampling_overrides) -> GenerationResult:
        """Sampling: pass `sampling=SamplingParams(...)` or any of its fields
        (temperature=, top_k=, top_p=, seed=) to override the engine's default."""
        return self.generate_ids(self.encode(prompt, chat_template), max_new_tokens, target_only, stop,
                                 sampling, **sampling_overrides)

    def _params(self, sampling: SamplingParams | None, overrides: dict) -> SamplingParams:
        unknown = set(overrides) - {f.name for f in dataclasses.fields(SamplingParams)}
        if unknown:
            raise GenerationError(f"unknown sampling option(s) {sorted(unknown)}; "
                                  f"allowed: temperature, top_k, top_p, seed")
        return dataclasses.replace(sampling or self.sampling,
                                   **{k: v for k, v in overrides.items() if v is not None})

    # ------------------------------------------------------------ the loop
    def generate_ids(self, prompt_ids: list[int], max_new_tokens: int | None = None,
                     target_only: bool = False, stop: list[str] | None = None,
                     sampling: SamplingParams | None = None, **sampling_overrides) -> GenerationResult:
        params = self._params(sampling, sampling_overrides)
        sampler = None if params.greedy else Sampler(params)
        target = self.target
        drafter = None if target_only else self.drafter
        n = len(prompt_ids)
        budget = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        if n == 0:
            raise GenerationError("the prompt is empty")
        if budget < 1:
            raise GenerationError(f"max_new_tokens must be >= 1, got {budget}")
        if n >= target.max_context:
            raise GenerationError(f"the prompt has {n} tokens but the target's context holds "
                                  f"{target.max_context}; shorten the prompt")
        stats = GenerationStats(mode="target-only" if drafter is None else drafter.name, prompt_tokens=n,
                                sampling=params.describe())
        if not target.precision.batch_invariant:
            stats.lossless = "up to numerics"
        stopper = StopChecker(budget, self.eos_ids, self.stop if stop is None else stop, self.tokenizer)
        # Drafts are capped at the tokens still wanted, so no verify writes past
        # position n + budget - 2: the prompt plus the budget always suffices.
        capacity = min(n + budget, target.max_context)
        t_start = time.perf_counter()
        seq = target.allocate(capacity)
        try:
            if drafter is not None:
                drafter.begin(capacity, sampler)
            if sampler is None:
                cur = target.greedy(seq, prompt_ids, 0, 1)[0]
            else:
                cur = sampler.sample_target(target.forward(seq, prompt_ids, 0, 1))
            stats.prefill_s = time.perf_counter() - t_start
            self._loop(seq, drafter, sampler, list(prompt_ids), cur, capacity, stopper, stats)
        finally:
            target.release(seq)
            if drafter is not None:
                drafter.reset()
        stats.total_s = time.perf_counter() - t_start
        stats.new_tokens = len(stopper.tokens)
        stats.finish_reason = stopper.reason
        return GenerationResult(stopper.text(), stopper.tokens, stats)

    def _verify(self, req: VerifyRequest, sampler: Sampler | None, draft_probs) -> VerifyResult:
        n = len(req.tokens)
        if sampler is None:
            return accept_greedy(req, self.target.greedy(req.seq_id, req.tokens, req.start, n))
        p = sampler.probs(self.target.forward(req.seq_id, req.tokens, req.start, n))
        accepted, tokens = sampler.accept(req.tokens[1:], p, draft_probs)
        return VerifyResult(req.seq_id, accepted, tokens)

    def _loop(self, seq, drafter, sampler, context, cur, capacity, stopper, stats) -> None:
        target, pos, synced = self.target, len(context), 0
        if stopper.feed(cur):
            return
        context.append(cur)
        while True:
            if pos >= capacity:  # no room to score another position
                stopper.reason = "context"
                return
            drafts: list[int] = []
            draft_probs = None
            # The bonus token is free: with r tokens left, r - 1 drafts suffice.
            k = min(self.policy.next_k(stopper.max_new_tokens - len(stopper.tokens) - 1), capacity - pos - 1)
            if drafter is not None and k > 0:
                t0 = time.perf_counter()
                proposal = drafter.draft(DraftRequest(seq, synced, k, context[synced:]))
                drafts = proposal.tokens[:k]
                if proposal.probs is not None:
                    draft_probs = proposal.probs[:len(drafts)]
                synced = len(context)
                stats.draft_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            result = self._verify(VerifyRequest(seq, pos, [cur] + drafts), sampler, draft_probs)
            target.truncate(seq, pos + result.accepted + 1)
            stats.verify_s += time.perf_counter() - t0
            stats.rounds += 1
            stats.drafted += len(drafts)
            stats.accepted += result.accepted
            self.policy.observe(len(drafts), result.accepted)
            pos += result.accepted + 1
            for token in result.tokens:
                if stopper.feed(token):
                    return
                context.append(token)
            cur = context[-1]


__all__ = ["Engine", "GenerationResult", "accept_greedy", "MAX_DRAFT_TOKENS"]
