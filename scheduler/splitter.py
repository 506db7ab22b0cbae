"""The splitter: which placement drafts, which verifies, and how far ahead.

From measured profiles (one per model and placement) and an acceptance
estimate per drafter, it predicts tokens/s for every candidate (drafter and
its placement, target placement, k) with the cost model, and ranks them. The
ranked list is the fallback order: when a device fails, the engine moves to
the best candidate that does not use it (`replan`). When the acceptance seen
online leaves the confidence interval of the estimate, `replan_if_drifted`
ranks again with the observed value.

The search: for each (drafter, target) pair the best k comes from the cost
model's branch and bound (equal to trying every k, fewer evaluations);
target-only (k = 0) is one candidate per target. Ties are broken, in order,
by the smaller k (less work for the same speed), drafter kind (none, ngram,
suffix, model, head, hybrid, cascade), in-process before a worker, then the
target's and the draft's placement labels, so a plan is a pure function of its
inputs.

The overlap: for each (drafter, target) pair, overlap.decide says whether the
engine will pre-draft round r+1 during round r's verify (the target's runner is
asynchronous and the drafter computes elsewhere); the pair's rounds are then
priced by overlap.round_seconds, so a CPU draft beside a GPU target is charged
only for the drafting the verify does not hide.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable

from hetero_sd.ir.errors import BackendError, ConfigError
from hetero_sd.scheduler.acceptance import AcceptanceTracker
from hetero_sd.scheduler.cost_model import (DRAFT_KINDS, DeviceProfile, DraftOption, Placement, RoundCost,
                                            Workload, round_cost, tokens_per_round)
from hetero_sd.scheduler.draft_length import AdaptiveDraftLength
from hetero_sd.scheduler.explain import explain
from hetero_sd.scheduler.overlap import OverlapDecision, OverlapMode, decide

KIND_ORDER = {"none": 0, **{kind: i + 1 for i, kind in enumerate(DRAFT_KINDS)}}


def matches(fixed: Placement | None, place: Placement) -> bool:
    """A fixed placement matches where each field is equal or "auto"; devices
    compare as backends resolve them (case-insensitive, "cuda" = "cuda:0").
    A precision of "default" must be resolved to the device's own first."""
    if fixed is None:
        return True
    want, have = fixed.device.lower(), place.device.lower()
    device_ok = want in ("auto", have) or f"{want}:0" == have
    return device_ok and fixed.backend in ("auto", place.backend) and fixed.precision in ("auto", place.precision)


@dataclass(frozen=True)
class Constraints:
    """What the user fixed, and what broke. None / "auto" fields are free."""

    target: Placement | None = None
    drafter: str | None = None  # "none" or one of cost_model.DRAFT_KINDS
    draft_placement: Placement | None = None  # where the draft model must run
    k: int | None = None  # a fixed k >= 1; None: the splitter picks 0..k_max
    failed: frozenset[str] = frozenset()  # device keys ("backend:device") not to use
    exact_only: bool = True  # targets must be batch-invariant (bitwise lossless)


@dataclass(frozen=True)
class Problem:
    targets: tuple[DeviceProfile, ...]
    drafters: tuple[DraftOption, ...] = ()
    k_max: int = 8
    constraints: Constraints = Constraints()
    workload: Workload | None = None  # None: rank by steady-state decode tokens/s
    overlap: OverlapMode = "auto"  # scheduler.overlap
    # drafter kinds that could not be offered, with why (a head with no trained head):
    # explain() lists them, so no kind is dropped silently
    unplanned: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Candidate:
    target: Placement
    drafter: str  # "none" or one of cost_model.DRAFT_KINDS
    draft_placement: Placement | None
    k: int
    alpha: float | None
    tokens_per_round: float
    round_s: float
    decode_tokens_per_s: float
    tokens_per_s: float  # end to end under the workload (else = decode_tokens_per_s)
    option: DraftOption | None = field(default=None, compare=False, repr=False)  # None: target-only
    overlap: OverlapDecision = OverlapDecision(False, "target-only: nothing to overlap")

    @property
    def devices(self) -> frozenset[str]:
        keys = {self.target.device_key}
        if self.draft_placement is not None:
            keys.add(self.draft_placement.device_key)
        return frozenset(keys)

    @property
    def drafter_label(self) -> str:
        if self.drafter == "none":
            return "target-only"
        if self.option is not None:
            return str(self.option)
        return self.drafter if self.draft_placement is None else f"{self.drafter}@{self.draft_placement}"

    @property
    def process(self) -> str:
        return self.option.process if self.option is not None else "inproc"

    def sort_key(self) -> tuple:
        return (-self.tokens_per_s, self.k, KIND_ORDER[self.drafter], self.process != "inproc", str(self.target),
                str(self.draft_placement or ""), self.drafter_label)


@dataclass(frozen=True)
class Plan:
    problem: Problem
    ranked: tuple[Candidate, ...]  # best first; one entry per (drafter, target) pair
    excluded: tuple[tuple[str, str], ...] = ()  # (what, why), for explain()
    evaluated: int = 0  # (pair, k) points the search computed
    exhaustive: int = 0  # points a brute-force search would compute

    @property
    def best(self) -> Candidate:
        return self.ranked[0]

    def speculative_for(self, target: Placement) -> Candidate | None:
        """The best candidate with a drafter on this target (for an adaptive k that
        starts from the plan but may turn speculation on when target-only ranked first)."""
        return next((c for c in self.ranked if c.target == target and c.k > 0), None)

    def round_cost(self, candidate: Candidate | None = None) -> RoundCost:
        """The cost model of one candidate's rounds (default: the best), e.g. as
        the prior of an AdaptiveDraftLength."""
        c = candidate or self.best
        target = next(t for t in self.problem.targets if t.placement == c.target)
        return round_cost(c.option, target, c.overlap.on)

    def adaptive_policy(self):
        """An AdaptiveDraftLength for the drafter this plan runs (the best
        candidate's, or the best drafter on the same target when target-only
        ranked first: the policy may turn speculation on), primed with its
        measured costs and acceptance estimate. None: no drafter on that target."""
        spec = self.best if self.best.k > 0 else self.speculative_for(self.best.target)
        if spec is None:
            return None
        prior = min(max(spec.alpha, 0.05), 0.95)  # a Beta prior mean must be inside (0, 1)
        return AdaptiveDraftLength(self.problem.k_max, cost=self.round_cost(spec), prior_alpha=prior)

    def explain(self) -> str:
        return explain(self)


def _usable_targets(problem: Problem, excluded: list) -> list[DeviceProfile]:
    c, out = problem.constraints, []
    for prof in problem.targets:
        p = prof.placement
        if p.device_key in c.failed:
            excluded.append((f"target {p}", "device failed"))
        elif c.exact_only and not prof.exact:
            excluded.append((f"target {p}", "not batch-invariant: lossless only up to numerics"))
        elif not matches(c.target, p):
            excluded.append((f"target {p}", f"config fixes the target to {c.target}"))
        else:
            out.append(prof)
    return out


def _usable_drafters(problem: Problem, excluded: list) -> list[DraftOption]:
    c, out = problem.constraints, []
    for opt in problem.drafters:
        if c.drafter not in (None, opt.kind):
            continue  # the user chose another kind: not worth a line
        p = opt.placement
        if p is not None and p.device_key in c.failed:
            excluded.append((f"draft {opt}", "device failed"))
        elif p is not None and not matches(c.draft_placement, p):
            excluded.append((f"draft {opt}", f"config fixes the draft model to {c.draft_placement}"))
        else:
            out.append(opt)
    return out


def _candidate(problem: Problem, target: DeviceProfile, draft: DraftOption | None, cost: RoundCost,
               k: int, rate: float, decision: OverlapDecision | None = None) -> Candidate:
    hit = draft.hit_rate if draft is not None else 1.0
    alpha = draft.alpha if draft is not None else None
    total = rate
    if problem.workload is not None:
        prefill = target.prefill(problem.workload.prompt_tokens)
        if draft is not None and k > 0:
            prefill += draft.prefill_s(problem.workload.prompt_tokens)
        total = problem.workload.tokens_per_s(rate, prefill)
    return Candidate(target.placement, draft.kind if draft is not None else "none",
                     draft.placement if draft is not None else None, k, alpha,
                     tokens_per_round(alpha or 0.0, k, hit), cost.seconds(k, hit, alpha), rate, total,
                     draft, decision or Candidate.overlap)


def pairs_with(draft: DraftOption, target: DeviceProfile) -> bool:
    """A head (or a hybrid over one) rides on its target's placement: it reads the
    target's hidden states in the target's process, so it pairs with that target only."""
    rides = draft.kind == "head" or (draft.kind == "hybrid" and draft.via == "head")
    return not rides or draft.placement == target.placement


def overlap_for(problem: Problem, target: DeviceProfile, draft: DraftOption) -> OverlapDecision:
    """What the engine will do for this pair (overlap.decide, the rule the engine uses)."""
    return decide(problem.overlap, target.placement.device, target.asynchronous, draft.device, draft.predrafts)


def plan(problem: Problem) -> Plan:
    """Rank every usable candidate; raise when the constraints leave none."""
    c = problem.constraints
    if problem.k_max < 1 or (c.k is not None and not 1 <= c.k <= problem.k_max):
        raise ConfigError(f"k_max must be >= 1 and a fixed k within 1..k_max; got k_max={problem.k_max}, k={c.k}")
    excluded: list[tuple[str, str]] = []
    targets = _usable_targets(problem, excluded)
    drafters = _usable_drafters(problem, excluded) if c.drafter != "none" else []
    out, evaluated, exhaustive = [], 0, 0
    for target in targets:
        if c.k is None or c.drafter == "none":  # target-only is the k = 0 candidate
            cost = round_cost(None, target)
            out.append(_candidate(problem, target, None, cost, 0, cost.rate(1.0, 0)))
            evaluated, exhaustive = evaluated + 1, exhaustive + 1
        for draft in (d for d in drafters if pairs_with(d, target)):
            decision = overlap_for(problem, target, draft)
            cost = round_cost(draft, target, decision.on)
            lo, hi = (1, problem.k_max) if c.k is None else (c.k, c.k)
            k, rate, n = cost.best_k(draft.alpha, hi, draft.hit_rate, k_min=lo)
            out.append(_candidate(problem, target, draft, cost, k, rate, decision))
            evaluated, exhaustive = evaluated + n, exhaustive + hi - lo + 1
    if not out:
        _raise_empty(problem, excluded)
    out.sort(key=Candidate.sort_key)
    return Plan(problem, tuple(out), tuple(excluded), evaluated, exhaustive)


def _raise_empty(problem: Problem, excluded: list) -> None:
    c = problem.constraints
    why = "; ".join(f"{what}: {reason}" for what, reason in excluded)
    if not why:
        why = (f"no profiled option for drafter {c.drafter!r} with k fixed to {c.k}"
               if c.k is not None else "no target profiles were given")
    if any(reason == "device failed" for _, reason in excluded):
        raise BackendError(f"no placement left after device failures ({', '.join(sorted(c.failed))}): {why}")
    raise ConfigError(f"no placement satisfies the constraints: {why}")


def replan(previous: Plan, failed: str | Iterable[str] = (), acceptance: dict[str, float] | None = None,
           keep_target: bool = False) -> Plan:
    """Plan again with more failed devices and/or new acceptance estimates
    ({"ngram": 0.3, "model": 0.8}: every option of that kind takes it; any kind of
    cost_model.DRAFT_KINDS).

    keep_target pins the target to the previous best's placement unless that
    device failed: mid-generation, moving the target costs a re-prefill and,
    across backends or precisions, changes the numerics the output is exact to,
    so a draft-side failure or an acceptance drift should move only the drafter.
    """
    problem = previous.problem
    failed = {failed} if isinstance(failed, str) else set(failed)
    cons = replace(problem.constraints, failed=problem.constraints.failed | frozenset(failed))
    if keep_target and previous.best.target.device_key not in cons.failed:
        cons = replace(cons, target=previous.best.target)
    problem = replace(problem, constraints=cons)
    if acceptance:
        unknown = set(acceptance) - set(DRAFT_KINDS)
        if unknown:
            raise ValueError(f"acceptance keys must be drafter kinds ({', '.join(DRAFT_KINDS)}), "
                             f"got {sorted(unknown)}")
        problem = replace(problem, drafters=tuple(
            replace(d, alpha=acceptance[d.kind]) if d.kind in acceptance else d for d in problem.drafters))
    return plan(problem)


def replan_if_drifted(previous: Plan, tracker: AcceptanceTracker, z: float = 3.0,
                      min_trials: float = 32.0, keep_target: bool = True) -> Plan | None:
    """A new plan if the acceptance observed for the drafter in use left the
    z-sigma interval around its estimate; None: keep the current plan.

    The drafter in use is the best candidate's, or, when target-only ranked
    first, the best drafter on the same target (an adaptive k runs it now and
    then to see whether speculation would pay after all)."""
    best = previous.best
    used = best if best.k > 0 else previous.speculative_for(best.target)
    if used is None or used.alpha is None or not tracker.drifted_from(used.alpha, z, min_trials):
        return None
    return replan(previous, acceptance={used.drafter: tracker.successes / tracker.trials},
                  keep_target=keep_target)
