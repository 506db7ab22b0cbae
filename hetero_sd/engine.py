"""The public `Engine` API: a target and a drafter, text in and out.

An Engine holds the target (wrapped for failover) and the drafter requests
start with, and makes requests: `engine.request(prompt_ids, ...)` is one
hetero_sd.request.Request, which carries a request through its phases
(start, propose, score, accept, close; the round loop lives there).
`generate` / `generate_ids` run one request to the end; the batching server
(hetero_sd/serve/batch.py) drives many at once through the same protocol.

Device failures and re-planning never reach the loop: the target and the
drafter are wrapped (hetero_sd/failover).
"""
from __future__ import annotations

import copy
import dataclasses
import threading
from typing import Callable

from hetero_sd.constraint import Constraint
from hetero_sd.drafting.base import Drafter
from hetero_sd.errors import GenerationError
from hetero_sd.failover import Fallback, FailoverDrafter, FailoverRunner, NoFallback, Replanner
from hetero_sd.ir.work import TokenHistory
from hetero_sd.request import GenerationResult, Request
from hetero_sd.sampling import Sampler, SamplingParams
from hetero_sd.scoring import Scorer
from hetero_sd.scheduler import FixedDraftLength
from hetero_sd.scheduler.mode import RequestMode
from hetero_sd.scheduler.overlap import OverlapDecision, OverlapMode, decide
from hetero_sd.scheduler.round import DraftLengthPolicy
from hetero_sd.stats import GenerationStats
from hetero_sd.stopping import StopChecker, TextStream

_COMPILER_LOCK = threading.Lock()


class Engine:
    """`target` is a Runner, `drafter` a Drafter (or None). `fallback` replaces
    a failed device, `replanner` a drafter whose acceptance drifted; a
    replacement serves later requests too (hetero_sd/failover).

    target_runner: the target as requests call it (a FailoverRunner: a device
    failure moves every sequence); `target`: the live device runner inside it."""

    def __init__(self, target, drafter: Drafter | None = None, k: int = 5, tokenizer=None,
                 eos_ids: tuple[int, ...] = (), max_new_tokens: int = 128, stop: tuple[str, ...] = (),
                 chat_template: bool = False, sampling: SamplingParams = SamplingParams(),
                 fallback: Fallback | None = None, policy: DraftLengthPolicy | None = None, replanner: Replanner | None = None, plan=None,
                 constraint: Constraint | dict | None = None, ignore_eos: bool = False, overlap: OverlapMode = "auto"):
        fallback = fallback or NoFallback()
        self.target_runner = FailoverRunner(target, fallback)
        self._drafter = FailoverDrafter(drafter, fallback, replanner)
        self.tokenizer = tokenizer
        self.sampling = sampling  # the default for requests that do not pass their own
        # How far ahead to draft: FixedDraftLength, or an AdaptiveDraftLength
        # (hetero_sd.scheduler) fed with each round's record.
        self.policy: DraftLengthPolicy = policy or FixedDraftLength(k)
        self.plan = plan  # the splitter's plan when placement was automatic
        self.eos_ids = set(eos_ids)  # the end-of-generation set (ir/eog.py)
        self.ignore_eos = ignore_eos  # run to max_new_tokens past it (benchmarks); grammars still end
        self.overlap_mode: OverlapMode = overlap  # drafting during verifies (scheduler.overlap)
        self.max_new_tokens, self.stop, self.chat_template = max_new_tokens, list(stop), chat_template
        self._compiler = None  # built on the first constrained request (llguidance's view of the tokenizer)
        # The default constraint (YAML generation.constraint), compiled now so a bad one fails at build.
        self.constraint = Constraint.of(constraint)
        if self.constraint is not None:
            self._guide(self.constraint)

    @property
    def target(self):
        """The live target runner (a failover's replacement once one happened)."""
        return self.target_runner.current

    @property
    def drafter(self) -> Drafter | None:
        """The drafter requests start with (a failover's or re-plan's replacement once one happened)."""
        return self._drafter.default

    @property
    def forks_drafter(self) -> bool:
        """Whether concurrent requests can speculate: the drafter serves several
        sequences at once (Drafter.can_fork)."""
        return self.drafter is not None and self.drafter.can_fork

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
        engine = cls(**engine_arguments(cfg, progress=progress, target_only=target_only))
        runner = engine.target_runner.current
        cap = cfg.scheduler.max_batch.get(runner.device.device)
        if cap is not None:  # scheduler.max_batch: this device's batched calls hold at most cap sequences
            runner.max_batch = min(runner.max_batch, cap) if runner.max_batch > 1 else 1
        return engine

    def close(self) -> None:
        """Stop worker processes the drafter holds, and a target in a Ray actor (also
        done when the process exits)."""
        self._drafter.close()
        self.target.close()  # (a local runner's memory is this process's: nothing to do)

    # ------------------------------------------------------------ text API
    def encode(self, prompt: str, chat_template: bool | None = None) -> list[int]:
        if self.tokenizer is None:
            raise GenerationError("this engine has no tokenizer; use generate_ids")
        return encode_text(self.tokenizer, prompt, self.chat_template if chat_template is None else chat_template)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """A conversation through the tokenizer's chat template, ready for the reply
        (tools: function definitions the template renders, where it has a place for them)."""
        return encode_messages(self.tokenizer, messages, tools)

    def generate(self, prompt: str, max_new_tokens: int | None = None, target_only: bool = False,
                 stop: list[str] | None = None, chat_template: bool | None = None,
                 sampling: SamplingParams | None = None, constraint: Constraint | dict | None = None,
                 on_text: Callable[[str], None] | None = None, **sampling_overrides) -> GenerationResult:
        """Sampling: pass `sampling=SamplingParams(...)` or any of its fields
        (temperature=, top_k=, top_p=, seed=) to override the engine's default.
        `constraint`: hold the output to a grammar (hetero_sd.constraint.Constraint,
        or {"json_schema": {...}} / {"regex": "..."} / {"grammar": "..."} / {"json": True});
        None uses the engine's default (YAML generation.constraint). on_text: the
        text as it is committed (generate_ids)."""
        return self.generate_ids(self.encode(prompt, chat_template), max_new_tokens, target_only, stop,
                                 sampling, constraint, on_text, **sampling_overrides)

    def _guide(self, constraint: Constraint):
        """A fresh grammar state for one request (compiled grammars are cached)."""
        from hetero_sd.constraint.guide import GuideCompiler
        from hetero_sd.errors import ConstraintError

        if self.tokenizer is None:
            raise ConstraintError(f"{constraint.where}: constrained decoding needs the engine's tokenizer")
        with _COMPILER_LOCK:  # (a server compiles on worker threads while its batch thread runs)
            if self._compiler is None:
                self._compiler = GuideCompiler(self.tokenizer, self.target_runner.vocab_size, tuple(self.eos_ids))
        return self._compiler.guide(constraint)

    def compile_constraint(self, constraint: Constraint | dict) -> None:
        """Compile and cache a constraint's grammar now (a server does it on a worker thread),
        so the request using it starts without the wait; ConstraintError for a bad one."""
        self._guide(Constraint.of(constraint))

    def _params(self, sampling: SamplingParams | None, overrides: dict) -> SamplingParams:
        known = [f.name for f in dataclasses.fields(SamplingParams)]
        unknown = set(overrides) - set(known)
        if unknown:
            raise GenerationError(f"unknown sampling option(s) {sorted(unknown)}; allowed: {', '.join(known)}")
        return dataclasses.replace(sampling or self.sampling,
                                   **{k: v for k, v in overrides.items() if v is not None})

    def generate_ids(self, prompt_ids: list[int], max_new_tokens: int | None = None,
                     target_only: bool = False, stop: list[str] | None = None,
                     sampling: SamplingParams | None = None, constraint: Constraint | dict | None = None,
                     on_text: Callable[[str], None] | None = None, prefix=None, logprobs: int | None = None,
                     **sampling_overrides) -> GenerationResult:
        """on_text(delta): called with the text as it is committed (deltas add up to the
        result's text exactly; hetero_sd.stopping.TextStream), the last one before this
        returns or raises. prefix: a hetero_sd.serve.prefix.PrefixCache whose kept
        sequence shares the prompt's first tokens copies their KV instead of a prefill,
        and keeps this request's sequence when it ends (a chat's earlier turns).
        logprobs: report each token's log-probability and this many top alternatives
        (GenerationResult.logprobs)."""
        req = self.request(prompt_ids, max_new_tokens, stop, self._params(sampling, sampling_overrides),
                           constraint, speculate=not target_only, logprobs=logprobs)
        stream = TextStream(req.stopper) if on_text is not None else None
        flush = (lambda: on_text(stream.delta())) if stream is not None else None
        try:
            req.run(self._copy_prefix(prefix, req, prompt_ids), flush)
        except GenerationError as exc:
            exc.partial = req.close()  # output produced so far is kept
            if stream is not None:
                on_text(stream.delta(final=True))
            if exc.partial.token_ids:
                exc.args = (f"{exc}; {len(exc.partial.token_ids)} tokens were produced before it",)
            raise
        except BaseException:  # Ctrl-C, a request that cannot fit, ...: the sequence is still freed
            req.close()
            raise
        result = req.close(release=prefix is None)
        if stream is not None:
            on_text(stream.delta(final=True))
        if prefix is not None:
            prefix.offer(req.seq, self.target_runner.tokens(req.seq))
        return result

    def _copy_prefix(self, prefix, req, prompt_ids: list[int]) -> int:
        """Positions of the prompt copied from the prefix cache's best match (0: none)."""
        hit = prefix.find(prompt_ids) if prefix is not None else None
        if hit is None or not self.target_runner.copy_prefix(hit.seq, req.seq, hit.length):
            return 0
        return hit.length

    def check_request(self, prompt_ids: list[int], max_new_tokens: int | None) -> int:
        """The request's token budget; GenerationError for a request no run could serve."""
        n = len(prompt_ids)
        budget = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        if n == 0:
            raise GenerationError("the prompt is empty")
        if budget < 1:
            raise GenerationError(f"max_new_tokens must be >= 1, got {budget}")
        if n >= self.target_runner.max_context:
            raise GenerationError(f"the prompt has {n} tokens but the target's context holds "
                                  f"{self.target_runner.max_context}; shorten the prompt")
        return budget

    def request(self, prompt_ids: list[int], max_new_tokens: int | None = None, stop: list[str] | None = None,
                sampling: SamplingParams | None = None, constraint: Constraint | dict | None = None,
                speculate: bool = True, learn_timings: bool = True, concurrent: bool = False,
                logprobs: int | None = None) -> Request:
        """One request, its target sequence allocated (hetero_sd.request.Request drives it).
        sampling None: the engine's default; constraint None: the engine's default, if any.
        speculate False: target-only. concurrent: the request runs beside others (the
        batching server), so it drafts with a fork of the drafter and a copy of the
        draft-length policy (and target-only when the drafter cannot fork).
        learn_timings False: the policy learns from acceptance alone (RequestMode.timed). logprobs: each
        committed token's log-probability and this many top alternatives (None: off).
        A request that is not concurrent drafts with the engine's own drafter and
        policy: run one such request at a time (generate does), and concurrent=True
        for more."""
        budget = self.check_request(prompt_ids, max_new_tokens)
        params = self.sampling if sampling is None else sampling
        constraint = Constraint.of(constraint) or self.constraint
        mode = RequestMode.of(params.greedy, params.seed, self.drafter is not None and self.drafter.one_hot,
                              concurrent, learn_timings)
        drafter, policy = self._drafting(speculate, mode)
        stats = GenerationStats(mode=drafter.name if drafter is not None else "target-only",
                                prompt_tokens=len(prompt_ids), sampling=params.describe())
        history = TokenHistory(prompt_ids)
        stopper = StopChecker(history, budget, set() if self.ignore_eos else self.eos_ids,
                              self.stop if stop is None else stop, self.tokenizer)
        guide = None if constraint is None else self._guide(constraint)  # a bad grammar fails here, before any token
        if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise GenerationError(f"logprobs asks for {logprobs} top tokens; allowed: 0..{MAX_TOP_LOGPROBS}")
        scorer = Scorer(None if params.greedy else Sampler(params, mode), params if params.penalized else None, logprobs)
        req = Request(self.target_runner, drafter, policy, stopper, stats, scorer, mode)
        if drafter is not None and not concurrent:  # (a batching server's rounds share batched calls)
            req.overlap = self.overlap()
        if guide is not None:
            req.constrain(guide, self.eos_ids, self.target_runner.vocab_size)
        return req

    def overlap(self) -> OverlapDecision:
        """Whether a request drafts its next round during each verify, and why (scheduler/overlap.py)."""
        d, t = self._drafter, self.target_runner
        return decide(self.overlap_mode, t.device.device, t.asynchronous,
                      d.draft_device if self.drafter is not None else None, d.predrafts)

    def _drafting(self, speculate: bool, mode: RequestMode):
        """(the request's drafter or None, its draft-length policy), as its mode says
        (scheduler/mode.py): the engine's own alone, a fork and a copy beside others."""
        drafter, policy = None, self.policy
        if speculate and self.drafter is not None and not mode.concurrent:
            drafter = self._drafter
        elif speculate and mode.concurrent and self.forks_drafter:
            drafter = FailoverDrafter(self.drafter.fork(), NoFallback())
        if drafter is not None and mode.own_policy:
            # learnt costs carried over (the policy as constructed when pinned), acceptance per request
            policy = self.policy.frozen() if mode.pinned else copy.deepcopy(self.policy)
        if drafter is not None:
            policy.reset()  # acceptance is per request; learnt costs are kept
        return drafter, policy


MAX_TOP_LOGPROBS = 20  # OpenAI's bound for top_logprobs


def encode_text(tokenizer, prompt: str, chat_template: bool) -> list[int]:
    """The prompt's ids, through the tokenizer's chat template when asked and it has one."""
    if chat_template and getattr(tokenizer, "chat_template", None):  # (a transformers tokenizer's)
        return encode_messages(tokenizer, [{"role": "user", "content": prompt}])
    return list(tokenizer(prompt)["input_ids"])


def encode_messages(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """A conversation through the tokenizer's chat template, ready for the reply."""
    extra = {"tools": [{"type": "function", "function": f} for f in tools]} if tools else {}
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **extra)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


__all__ = ["Engine", "GenerationResult", "Request", "encode_messages", "encode_text"]
