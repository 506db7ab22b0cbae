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
from hetero_sd.failover import Fallback, NoFallback, describe, is_device_failure
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
                 sampling: SamplingParams = SamplingParams(), fallback: Fallback | None = None,
                 policy=None):
        self.target, self.drafter, self.tokenizer = target, drafter, tokenizer
        self.fallback = fallback or NoFallback()  # who takes over when a device fails
        self.sampling = sampling  # the default for requests that do not pass their own
        # How far ahead to draft: FixedDraftLength, or an AdaptiveDraftLength
        # (hetero_sd.scheduler) fed with acceptance and timings after each round.
        self.policy = policy or FixedDraftLength(k)
        self.plan = None  # the splitter's plan when placement was automatic (see builder)
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
        drafter = None if target_only else self.drafter
        n = len(prompt_ids)
        budget = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        if n == 0:
            raise GenerationError("the prompt is empty")
        if budget < 1:
            raise GenerationError(f"max_new_tokens must be >= 1, got {budget}")
        if n >= self.target.max_context:
            raise GenerationError(f"the prompt has {n} tokens but the target's context holds "
                                  f"{self.target.max_context}; shorten the prompt")
        stats = GenerationStats(mode="target-only" if drafter is None else drafter.name, prompt_tokens=n,
                                sampling=params.describe())
        stopper = StopChecker(budget, self.eos_ids, self.stop if stop is None else stop, self.tokenizer)
        if drafter is not None:
            self.policy.reset()  # acceptance is per request; learnt costs are kept
        run = _Run(self, drafter, None if params.greedy else Sampler(params), stopper, stats, list(prompt_ids))
        t_start = time.perf_counter()
        try:
            run.prefill()
            stats.prefill_s = time.perf_counter() - t_start
            run.loop()
        except GenerationError as exc:
            exc.partial = run.result(time.perf_counter() - t_start)  # output produced so far is kept
            raise
        finally:
            run.close()
        return run.result(time.perf_counter() - t_start)


class _Run:
    """One request's state: the committed context, the target's sequence and
    position, the drafter's sync point. Devices may be swapped mid-run."""

    def __init__(self, engine: Engine, drafter, sampler, stopper, stats, prompt: list[int]):
        self.engine, self.drafter, self.sampler = engine, drafter, sampler
        self.stopper, self.stats, self.prompt = stopper, stats, prompt
        self.context = list(prompt)
        # Drafts are capped at the tokens still wanted, so no verify writes past
        # position n + budget - 2: the prompt plus the budget always suffices.
        self.capacity = min(len(prompt) + stopper.max_new_tokens, engine.target.max_context)
        self.target, self.seq = engine.target, engine.target.allocate(self.capacity)
        self.pos = self.synced = 0  # positions in the target cache; tokens the drafter knows
        self._mark_numerics()

    def _mark_numerics(self) -> None:
        if not self.target.precision.batch_invariant:
            self.stats.lossless = "up to numerics"

    # ---------------------------------------------------------------- target
    def prefill(self) -> None:
        if self.drafter is not None:
            try:
                self.drafter.begin(self.capacity, self.sampler)
            except Exception as exc:
                self._drafter_failed(exc)
        logits = self._on_target(lambda: self._score(self.prompt, 0, 1))
        self.pos = len(self.prompt)
        self.cur = logits[0]

    def _score(self, tokens: list[int], start: int, n: int):
        """The target's next token after each of the last n tokens (greedy ids,
        or float64 distributions when sampling)."""
        if self.sampler is None:
            return self.target.greedy(self.seq, tokens, start, n)
        return self.sampler.probs(self.target.forward(self.seq, tokens, start, n))

    def _on_target(self, call):
        while True:
            try:
                return call()
            except Exception as exc:
                if not is_device_failure(exc):
                    raise
                self._target_failed(exc)

    def _target_failed(self, exc: BaseException) -> None:
        failed = self.target
        replacement = self.engine.fallback.next_target(failed, exc)
        self.stats.events.append(f"target {_where(failed)} failed: {describe(exc)}")
        if replacement is None:
            raise GenerationError(f"the target on {_where(failed)} failed ({describe(exc)}) and no other "
                                  f"device can take it; {len(self.stopper.tokens)} tokens were produced "
                                  "before the failure") from exc
        try:
            failed.release(self.seq)
        except Exception:  # a dead device may not even release; its pool goes with it
            pass
        self.target, self.engine.target = replacement, replacement
        self.seq = replacement.allocate(self.capacity)
        self._mark_numerics()
        n = len(self.prompt)  # replay exactly as the failed target saw it: prefill, then verify-shaped
        replacement.forward(self.seq, self.prompt, 0, 1)
        if self.pos > n:
            replacement.forward(self.seq, self.context[n:self.pos], n, self.pos - n)
        self.stats.events.append(f"target moved to {_where(replacement)}; {self.pos} positions replayed")

    # ---------------------------------------------------------------- drafter
    def _draft(self, k: int):
        """(drafts, their distributions or None, seconds or None if the drafter failed)."""
        t0 = time.perf_counter()
        try:
            proposal = self.drafter.draft(DraftRequest(self.seq, self.synced, k, self.context[self.synced:]))
        except Exception as exc:
            self.stats.draft_s += time.perf_counter() - t0
            self._drafter_failed(exc)
            return [], None, None
        seconds = time.perf_counter() - t0
        self.stats.draft_s += seconds
        self.synced = len(self.context)
        drafts = proposal.tokens[:k]
        return drafts, None if proposal.probs is None else proposal.probs[:len(drafts)], seconds

    def _drafter_failed(self, exc: BaseException) -> None:
        failed, self.drafter = self.drafter, None
        self.stats.events.append(f"drafter {failed.name} failed: {describe(exc)}")
        try:
            failed.reset()
        except Exception:
            pass
        replacement = self.engine.fallback.next_drafter(failed, exc)
        if replacement is not None:
            try:
                replacement.begin(self.capacity, self.sampler)
            except Exception as again:
                self.drafter = replacement
                return self._drafter_failed(again)
            self.drafter, self.synced = replacement, 0
            self.engine.drafter = replacement
        self.stats.events.append(f"drafting continues with {replacement.name if replacement else 'none'}")

    def _replan(self, drafted: int, accepted: int) -> None:
        """Let the plan (placement: auto) swap the drafter when acceptance drifted."""
        on_round = getattr(self.engine.fallback, "on_round", None)
        replacement = on_round(drafted, accepted) if on_round is not None and drafted else None
        if replacement is None or self.drafter is None:
            return
        old = self.drafter
        try:
            replacement.begin(self.capacity, self.sampler)
        except Exception as exc:
            self.stats.events.append(f"re-plan to {replacement.name} failed at start: {describe(exc)}")
            return
        old.reset()
        self.drafter = self.engine.drafter = replacement
        self.synced = 0
        self.stats.events.append(f"acceptance drifted: drafter {old.name} -> {replacement.name}")

    # ---------------------------------------------------------------- rounds
    def loop(self) -> None:
        stopper, stats, policy = self.stopper, self.stats, self.engine.policy
        if self._commit([self._token(self.cur)]):
            return
        while True:
            if self.pos >= self.capacity:  # no room to score another position
                stopper.reason = "context"
                return
            drafts, draft_probs, draft_s = [], None, None
            speculating = self.drafter is not None
            if speculating:
                # The bonus token is free: with r tokens left, r - 1 drafts suffice.
                k = min(policy.next_k(stopper.max_new_tokens - len(stopper.tokens) - 1),
                        self.capacity - self.pos - 1)
                if k > 0:
                    drafts, draft_probs, draft_s = self._draft(k)
            events, t0 = len(stats.events), time.perf_counter()
            result = self._on_target(lambda: self._verify(drafts, draft_probs))
            verify_s = time.perf_counter() - t0
            stats.verify_s += verify_s
            stats.rounds += 1
            stats.drafted += len(drafts)
            stats.accepted += result.accepted
            if speculating:  # a round with a device swap in it teaches no cost
                clean = len(stats.events) == events
                policy.observe(len(drafts), result.accepted, draft_s=draft_s if clean else None,
                               verify_s=verify_s if clean else None)
                self._replan(len(drafts), result.accepted)
            if self._commit(result.tokens):
                return

    def _verify(self, drafts: list[int], draft_probs) -> VerifyResult:
        req = VerifyRequest(self.seq, self.pos, [self.context[-1]] + drafts)
        scored = self._score(req.tokens, req.start, len(req.tokens))
        if self.sampler is None:
            result = accept_greedy(req, scored)
        else:
            accepted, tokens = self.sampler.accept(drafts, scored, draft_probs)
            result = VerifyResult(req.seq_id, accepted, tokens)
        self.target.truncate(self.seq, self.pos + result.accepted + 1)
        return result

    def _token(self, scored) -> int:
        return scored if self.sampler is None else self.sampler.draw_target(scored)

    def _commit(self, tokens: list[int]) -> bool:
        """Append committed tokens; True when generation is over."""
        for token in tokens:
            if self.stopper.feed(token):
                return True
            self.context.append(token)
        self.pos = len(self.context) - 1  # the newest token is fed with the next verify
        return False

    def result(self, elapsed: float) -> GenerationResult:
        stats = self.stats
        stats.total_s, stats.new_tokens, stats.finish_reason = elapsed, len(self.stopper.tokens), self.stopper.reason
        return GenerationResult(self.stopper.text(), list(self.stopper.tokens), stats)

    def close(self) -> None:
        for release in (lambda: self.target.release(self.seq),
                        lambda: self.drafter is not None and self.drafter.reset()):
            try:
                release()
            except Exception:
                if not self.stats.events:  # after a device failure, its cleanup may fail too
                    raise


def _where(runner) -> str:
    return f"{getattr(runner.device, 'backend', '?')}:{getattr(runner.device, 'device', '?')}"


__all__ = ["Engine", "GenerationResult", "accept_greedy", "MAX_DRAFT_TOKENS"]
