"""The engine: the speculative round loop and the public `Engine` API.

One round: the drafter proposes k tokens; the target scores the last
committed token plus the drafts in one call (k+1 positions); the longest
prefix of drafts equal to the target's own greedy choices is accepted, and
the target's next token after it (the bonus) is committed too. The target's
cache then rolls back to the committed length, a length change in its pool
(the drafter re-syncs its own from the next request's delta). Target-only
decoding is the same loop with no drafts, so the two share every line that
could make them differ.

With temperature > 0 the round is the same except for acceptance: modified
rejection sampling (hetero_sd/sampling.py) replaces the greedy comparison, so
committed tokens follow the target's distribution exactly.

Device failures and re-planning never reach the loop: the target and the
drafter are wrapped (hetero_sd/failover.py).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np

from hetero_sd.constraint import Constraint
from hetero_sd.drafting.base import Drafter
from hetero_sd.errors import GenerationError
from hetero_sd.failover import Fallback, FailoverDrafter, FailoverRunner, NoFallback, Replanner
from hetero_sd.ir.work import DraftRequest, VerifyResult
from hetero_sd.sampling import Sampler, SamplingParams, accept_greedy
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


class Engine:
    """`target` is a Runner, `drafter` a Drafter (or None). `fallback` replaces
    a failed device, `replanner` a drafter whose acceptance drifted; a
    replacement serves later requests too (hetero_sd/failover.py)."""

    def __init__(self, target, drafter: Drafter | None = None, k: int = 5, tokenizer=None,
                 eos_ids: tuple[int, ...] = (), max_new_tokens: int = 128, stop: tuple[str, ...] = (),
                 chat_template: bool = False, sampling: SamplingParams = SamplingParams(),
                 fallback: Fallback | None = None, policy=None, replanner: Replanner | None = None, plan=None,
                 constraint: Constraint | dict | None = None):
        fallback = fallback or NoFallback()
        self._target = FailoverRunner(target, fallback)
        self._drafter = FailoverDrafter(drafter, fallback, replanner)
        self.tokenizer = tokenizer
        self.sampling = sampling  # the default for requests that do not pass their own
        # How far ahead to draft: FixedDraftLength, or an AdaptiveDraftLength
        # (hetero_sd.scheduler) fed with acceptance and timings after each round.
        self.policy = policy or FixedDraftLength(k)
        self.plan = plan  # the splitter's plan when placement was automatic
        self.eos_ids = set(eos_ids)
        self.max_new_tokens, self.stop, self.chat_template = max_new_tokens, list(stop), chat_template
        self._compiler = None  # built on the first constrained request (llguidance's view of the tokenizer)
        # The default constraint (YAML generation.constraint), compiled now so a bad one fails at build.
        self.constraint = Constraint.of(constraint)
        if self.constraint is not None:
            self._guide(self.constraint)

    @property
    def target(self):
        """The live target runner (a failover's replacement once one happened)."""
        return self._target.current

    @property
    def drafter(self) -> Drafter | None:
        """The drafter requests start with (a failover's or re-plan's replacement once one happened)."""
        return self._drafter.current

    @classmethod
    def from_config(cls, config=None, progress: bool = False, target_only: bool = False,
                    **overrides) -> "Engine":
        """Build from a YAML file or a loaded Config (None: the packaged default, configs/cpu.yaml).
        `overrides` are dotted keys, e.g. {"generation.max_new_tokens": 32}. target_only: build
        the target alone, ignoring the drafter section (no draft model loaded, no worker started)."""
        from hetero_sd.build import engine_arguments
        from hetero_sd.config import Config, load_config
        from hetero_sd.errors import ConfigError

        if isinstance(config, Config) and overrides:
            raise ConfigError("overrides apply to a YAML path; pass load_config(path, overrides) instead")
        cfg = config if isinstance(config, Config) else load_config(config, overrides)
        return cls(**engine_arguments(cfg, progress=progress, target_only=target_only))

    def close(self) -> None:
        """Stop worker processes the drafter holds, and a target in a Ray actor (also
        done when the process exits)."""
        self._drafter.close()
        close = getattr(self.target, "close", None)  # local runners have none: their memory is this process's
        if close is not None:
            close()

    # ------------------------------------------------------------ text API
    def encode(self, prompt: str, chat_template: bool | None = None) -> list[int]:
        if self.tokenizer is None:
            raise GenerationError("this engine has no tokenizer; use generate_ids")
        use_chat = self.chat_template if chat_template is None else chat_template
        if use_chat and getattr(self.tokenizer, "chat_template", None):
            return self.encode_chat([{"role": "user", "content": prompt}])
        return list(self.tokenizer(prompt)["input_ids"])

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """A conversation through the tokenizer's chat template, ready for the reply."""
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def generate(self, prompt: str, max_new_tokens: int | None = None, target_only: bool = False,
                 stop: list[str] | None = None, chat_template: bool | None = None,
                 sampling: SamplingParams | None = None, constraint: Constraint | dict | None = None,
                 **sampling_overrides) -> GenerationResult:
        """Sampling: pass `sampling=SamplingParams(...)` or any of its fields
        (temperature=, top_k=, top_p=, seed=) to override the engine's default.
        `constraint`: hold the output to a grammar (hetero_sd.constraint.Constraint,
        or {"json_schema": {...}} / {"regex": "..."} / {"grammar": "..."} / {"json": True});
        None uses the engine's default (YAML generation.constraint)."""
        return self.generate_ids(self.encode(prompt, chat_template), max_new_tokens, target_only, stop,
                                 sampling, constraint, **sampling_overrides)

    def _guide(self, constraint: Constraint):
        """A fresh grammar state for one request (compiled grammars are cached)."""
        from hetero_sd.constraint.guide import GuideCompiler
        from hetero_sd.errors import ConstraintError

        if self.tokenizer is None:
            raise ConstraintError(f"{constraint.where}: constrained decoding needs the engine's tokenizer")
        if self._compiler is None:
            self._compiler = GuideCompiler(self.tokenizer, self._target.vocab_size, tuple(self.eos_ids))
        return self._compiler.guide(constraint)

    def _params(self, sampling: SamplingParams | None, overrides: dict) -> SamplingParams:
        unknown = set(overrides) - {f.name for f in dataclasses.fields(SamplingParams)}
        if unknown:
            raise GenerationError(f"unknown sampling option(s) {sorted(unknown)}; "
                                  f"allowed: temperature, top_k, top_p, seed")
        return dataclasses.replace(sampling or self.sampling,
                                   **{k: v for k, v in overrides.items() if v is not None})

    def generate_ids(self, prompt_ids: list[int], max_new_tokens: int | None = None,
                     target_only: bool = False, stop: list[str] | None = None,
                     sampling: SamplingParams | None = None, constraint: Constraint | dict | None = None,
                     **sampling_overrides) -> GenerationResult:
        params = self._params(sampling, sampling_overrides)
        speculate = not target_only and self.drafter is not None
        if speculate:
            self.policy.reset()  # acceptance is per request; learnt costs are kept
        run = self.new_run(prompt_ids, max_new_tokens, stop, params, constraint,
                           self._drafter if speculate else None, self.policy)
        try:
            run.run()
        except GenerationError as exc:
            exc.partial = run.close()  # output produced so far is kept
            if exc.partial.token_ids:
                exc.args = (f"{exc}; {len(exc.partial.token_ids)} tokens were produced before it",)
            raise
        except BaseException:  # Ctrl-C, a request that cannot fit, ...: the sequence is still freed
            run.close()
            raise
        return run.close()

    def check_request(self, prompt_ids: list[int], max_new_tokens: int | None) -> int:
        """The request's token budget; GenerationError for a request no run could serve."""
        n = len(prompt_ids)
        budget = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        if n == 0:
            raise GenerationError("the prompt is empty")
        if budget < 1:
            raise GenerationError(f"max_new_tokens must be >= 1, got {budget}")
        if n >= self._target.max_context:
            raise GenerationError(f"the prompt has {n} tokens but the target's context holds "
                                  f"{self._target.max_context}; shorten the prompt")
        return budget

    def new_run(self, prompt_ids: list[int], max_new_tokens: int | None, stop: list[str] | None,
                params: SamplingParams, constraint, drafter: FailoverDrafter | None, policy) -> "_Run":
        """One request's state, its target sequence allocated (the batching server
        drives many at once: hetero_sd.serve.batch)."""
        budget = self.check_request(prompt_ids, max_new_tokens)
        constraint = Constraint.of(constraint) or self.constraint
        stats = GenerationStats(mode=drafter.name if drafter is not None else "target-only",
                                prompt_tokens=len(prompt_ids), sampling=params.describe())
        stopper = StopChecker(budget, self.eos_ids, self.stop if stop is None else stop, self.tokenizer)
        guide = None if constraint is None else self._guide(constraint)  # a bad grammar fails here, before any token
        run = _Run(self._target, drafter, policy, None if params.greedy else Sampler(params), stopper, stats,
                   list(prompt_ids))
        if guide is not None:
            run.constrain(guide, self.eos_ids, self._target.vocab_size)
        return run


@dataclass
class _Round:
    """One planned round: the rows to score from position `start` and the drafts among them."""
    start: int
    tokens: list[int]  # VerifyRequest.tokens: the last committed token + the drafts
    drafts: list[int]
    draft_probs: object
    draft_s: float | None
    speculating: bool
    t0: float


class _Run:
    """One request: the committed context, the target's sequence and position,
    and how much of the context the drafter has been told."""

    def __init__(self, target: FailoverRunner, drafter: FailoverDrafter | None, policy, sampler: Sampler | None,
                 stopper: StopChecker, stats: GenerationStats, prompt: list[int]):
        self.target, self.drafter, self.policy, self.sampler = target, drafter, policy, sampler
        self.stopper, self.stats, self.prompt, self.context = stopper, stats, prompt, list(prompt)
        # Drafts are capped at the tokens still wanted, so no verify writes past
        # position n + budget - 2: the prompt plus the budget always suffices.
        self.capacity = min(len(prompt) + stopper.max_new_tokens, target.max_context)
        self.t_start = time.perf_counter()
        self.seq = target.allocate(self.capacity)
        self.pos = self.synced = 0  # positions in the target's cache; tokens the drafter was told
        self.constrainer = None  # hetero_sd.constraint.rounds.Constrainer when the output has a grammar
        # Whether the draft-length policy learns from timings. Off, its choices
        # depend on acceptance alone, so a seeded sampled request draws the same
        # tokens whatever runs beside it (the batching server).
        self.timed = True
        # The target's hidden states of rows whose next token is committed, not yet
        # told to the drafter: a head drafter reads them (a target loaded with
        # feature layers only when one is configured).
        self.features: list | None = [] if drafter is not None and getattr(target, "feature_layers", ()) \
            else None

    def constrain(self, guide, eos_ids: set[int], model_vocab: int) -> None:
        from hetero_sd.constraint.rounds import Constrainer

        self.constrainer = Constrainer(guide, eos_ids, self.stats, model_vocab)

    def run(self) -> None:
        """Prefill, then rounds of draft, verify, accept, commit (rollback is in _verify)."""
        if self.start():
            return
        while True:
            planned = self.plan()
            if planned is None:
                return
            if self.finish(planned, self._score(planned.tokens, planned.start, len(planned.tokens))):
                return

    def start(self, cached: int = 0) -> bool:
        """Begin the drafter and prefill the prompt; True when generation is already over.
        cached: leading prompt positions whose KV the target sequence already holds
        (copied from an earlier request's by a serving prefix cache)."""
        con = self.constrainer
        if self.drafter is not None:
            self.drafter.begin(self.capacity, self.sampler, None if con is None else con.guide)
        if con is not None:
            con.prepare([])
        self.stats.cached_tokens = cached
        first = self._score(self.prompt[cached:], cached, 1)[0]
        self._keep_features(len(self.prompt) - cached)
        self.pos = len(self.prompt)
        self.stats.prefill_s = time.perf_counter() - self.t_start
        return self._commit([first if self.sampler is None else self.sampler.draw_target(first)])

    def plan(self) -> "_Round | None":
        """Draft for the next round: the rows the target must score (the last
        committed token plus the drafts). None when the context is full."""
        if self.pos >= self.capacity:  # no room to score another position
            self.stopper.reason = "context"
            return None
        speculating = self.drafter is not None and self.drafter.active
        # The bonus token is free: with r tokens left, r - 1 drafts suffice.
        k = min(self.policy.next_k(self.stopper.max_new_tokens - len(self.stopper.tokens) - 1),
                self.capacity - self.pos - 1) if speculating else 0
        drafts, draft_probs, draft_s = self._draft(k) if k > 0 else ([], None, None)
        if self.constrainer is not None:
            self.constrainer.prepare(drafts)
        return _Round(self.pos, [self.context[-1]] + drafts, drafts, draft_probs, draft_s, speculating,
                      time.perf_counter())

    def finish(self, rnd: "_Round", scored, verify_s: float | None = None) -> bool:
        """Accept against the target's scores for the round's rows (greedy ids or
        distributions, as _score/score_logits give them) and commit; True when over.
        verify_s: this request's share of a batched call (default: the time since plan)."""
        result = self._verify(rnd.drafts, rnd.draft_probs, scored)
        self._keep_features(result.accepted + 1)  # the rows of the last committed token and the accepted drafts
        self._account(rnd.speculating, len(rnd.drafts), result.accepted, rnd.draft_s,
                      time.perf_counter() - rnd.t0 if verify_s is None else verify_s)
        return self._commit(result.tokens)

    def score_logits(self, logits):
        """What _score returns, from the target's logits for this request's rows
        (a batched forward's share)."""
        if self.constrainer is not None:
            logits = self.constrainer.apply(logits)
        if self.sampler is None:
            return [int(i) for i in logits.argmax(-1)]
        return self.sampler.probs(logits)

    def _score(self, tokens: list[int], start: int, n: int):
        """The target's next token after each of the last n tokens (greedy ids,
        or float64 distributions when sampling)."""
        if self.constrainer is None and self.sampler is None:
            return self.target.greedy(self.seq, tokens, start, n)
        return self.score_logits(self.target.forward(self.seq, tokens, start, n))

    def _keep_features(self, rows: int) -> None:
        """Keep the first `rows` rows of the target's features from its latest call on this sequence."""
        if self.features is None:
            return
        got = self.target.take_features(self.seq)
        if got is None:  # (a failover replayed the sequence: the drafter goes without these rows)
            self.features.clear()
        else:
            self.features.append(got[:rows])

    def _request(self, k: int) -> DraftRequest:
        req = DraftRequest(self.seq, self.synced, k, self.context[self.synced:])
        if self.features:
            req.features = self.features[0] if len(self.features) == 1 else np.concatenate(self.features)
            self.features.clear()
        return req

    def _draft(self, k: int):
        """(drafts, their distributions or None, seconds)."""
        t0 = time.perf_counter()
        proposal = self.drafter.draft(self._request(k))
        seconds = time.perf_counter() - t0
        self.stats.draft_s += seconds
        if self._take_events():  # a failover in this call: its time is not a draft cost
            seconds = None
        self.synced = len(self.context)
        drafts = proposal.tokens[:k]
        probs = None if proposal.probs is None else proposal.probs[:len(drafts)]
        if self.constrainer is not None:
            drafts, probs = self.constrainer.cut(drafts, probs, k)
        return drafts, probs, seconds

    def _verify(self, drafts: list[int], draft_probs, scored) -> VerifyResult:
        if self.sampler is None:
            accepted, tokens = accept_greedy(drafts, scored)
        else:
            accepted, tokens = self.sampler.accept(drafts, scored, draft_probs)
        self.target.truncate(self.seq, self.pos + accepted + 1)  # rollback: a length change
        return VerifyResult(self.seq, accepted, tokens)

    def _account(self, speculating: bool, drafted: int, accepted: int, draft_s, verify_s: float) -> None:
        stats = self.stats
        stats.verify_s += verify_s
        stats.rounds, stats.drafted, stats.accepted = stats.rounds + 1, stats.drafted + drafted, \
            stats.accepted + accepted
        stats.count_positions(drafted, accepted)
        if self._take_events() or not self.timed:  # a target swap in the verify: its time teaches no cost
            draft_s = verify_s = None
        if speculating:  # (target-only rounds feed no policy)
            self.policy.observe(drafted, accepted, draft_s=draft_s, verify_s=verify_s)
            self.drafter.observe(drafted, accepted)

    def _take_events(self) -> list[str]:
        events = self.target.take_events() + (self.drafter.take_events() if self.drafter is not None else [])
        self.stats.events += events
        if not self.target.precision.batch_invariant:
            self.stats.lossless = "up to numerics"
        return events

    def _commit(self, tokens: list[int]) -> bool:
        """Append committed tokens; True when generation is over."""
        con = self.constrainer
        for token in tokens:
            if con is not None and token not in self.stopper.eos_ids and con.commit(token):
                # The language ended: stop where target-only would. A stop string this
                # token completes keeps its reason (the text is cut there).
                if not self.stopper.feed(token) or self.stopper.reason == "length":
                    self.stopper.reason = "grammar"
                return True
            if self.stopper.feed(token):
                return True
            self.context.append(token)
        self.pos = len(self.context) - 1  # the newest token is fed with the next verify
        return False

    def close(self, release: bool = True) -> GenerationResult:
        """Free the sequence (unless release=False: a prefix cache keeps it) and the
        drafter's state; the result so far."""
        if release:
            self.target.release(self.seq)
        if self.constrainer is not None:
            self.constrainer.close()
        if self.drafter is not None:
            self.drafter.reset()
        self._take_events()
        stats = self.stats
        stats.total_s, stats.new_tokens = time.perf_counter() - self.t_start, len(self.stopper.tokens)
        stats.finish_reason = self.stopper.reason
        return GenerationResult(self.stopper.text(), list(self.stopper.tokens), stats)


def build_engine(cfg, progress: bool = False) -> Engine:
    """An Engine from a loaded Config (Engine.from_config also takes a path)."""
    return Engine.from_config(cfg, progress=progress)


__all__ = ["Engine", "GenerationResult", "build_engine"]
