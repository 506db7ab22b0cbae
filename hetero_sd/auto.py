"""`placement: auto`: from a config with free fields to a plan, and from the
plan to runners, a drafter, a draft-length policy and a failover chain.

A field the YAML sets is pinned; one it leaves out (or sets to "auto") is the
splitter's to choose. The profile behind the plan is measured once per host,
model and precision and cached (hetero_sd/profiler.py), so only the first
automatic run on a machine pays for it.
"""
from __future__ import annotations

import sys
from pathlib import Path

from hetero_sd.backends.registry import Registry
from hetero_sd.config import Config
from hetero_sd.errors import BackendError
from hetero_sd.scheduler import (AcceptanceTracker, Constraints, FixedDraftLength, Placement, Workload, replan,
                                 replan_if_drifted)


def _pinned(section, registry: Registry) -> Placement | None:
    """The part of a placement the user fixed, "auto" for the rest."""
    from hetero_sd.builder import check_placement

    given = section.model_fields_set
    backend = section.backend if "backend" in given and section.backend != "auto" else "auto"
    device = section.device if "device" in given and section.device != "auto" else "auto"
    precision = section.precision if "precision" in given and section.precision != "auto" else "auto"
    if backend != "auto" and device != "auto":
        info, prec = check_placement(registry, section, "placement")
        device = info.device
        precision = prec.name if precision != "auto" else "auto"
    if (backend, device, precision) == ("auto", "auto", "auto"):
        return None
    return Placement(backend, device, precision)


def constraints(cfg: Config, registry: Registry) -> Constraints:
    d = cfg.drafter
    return Constraints(target=_pinned(cfg.target, registry),
                       drafter=None if d.kind == "auto" else d.kind,
                       draft_placement=_pinned(d, registry) if d.kind in ("auto", "model") else None,
                       k=None if d.k == "auto" else d.k)


class PlanFallback:
    """Failover along the plan's ranking: a failed device is excluded and the
    best remaining candidate takes the role (the target stays put when only
    the drafter failed, so the output stays exact to the same numerics)."""

    CHECK_EVERY = 32  # rounds between drift checks

    def __init__(self, plan, load_target, make_drafter):
        self.plan, self._load_target, self._make_drafter = plan, load_target, make_drafter
        self.tracker, self._rounds = AcceptanceTracker(), 0
        self.drafter_label = self._spec_label(plan)

    @staticmethod
    def _spec_label(plan) -> str | None:
        spec = plan.best if plan.best.k > 0 else plan.speculative_for(plan.best.target)
        return None if spec is None else spec.drafter_label

    def on_round(self, drafted: int, accepted: int):
        """Fed every round. When the acceptance seen leaves the plan's estimate
        (scheduler.replan_if_drifted), plan again with it; a new drafter if
        the new plan drafts differently, else None. The target stays put."""
        self.tracker.observe(drafted, accepted)
        self._rounds += 1
        if self._rounds % self.CHECK_EVERY:
            return None
        new = replan_if_drifted(self.plan, self.tracker)
        if new is None:
            return None
        self.plan, self.tracker = new, AcceptanceTracker()
        label = self._spec_label(new)
        if label == self.drafter_label:
            return None
        self.drafter_label = label
        spec = new.speculative_for(new.best.target)
        return None if spec is None else self._make_drafter(spec)

    def next_drafter(self, failed, error):
        runner = getattr(failed, "runner", None)
        if runner is None:  # the n-gram drafter has no device to exclude
            return None
        try:
            self.plan = replan(self.plan, failed=_device_key(runner), keep_target=True)
        except BackendError:
            return None
        spec = self.plan.speculative_for(self.plan.best.target)
        return None if spec is None else self._make_drafter(spec)

    def next_target(self, failed, error):
        key = _device_key(failed)
        while True:
            try:
                self.plan = replan(self.plan, failed=key)
            except BackendError:
                return None
            try:
                return self._load_target(self.plan.best.target)
            except Exception as exc:  # the next device may be dead too
                key = self.plan.best.target.device_key
                print(f"hetero-sd: {self.plan.best.target} unavailable ({exc}); trying the next", file=sys.stderr)


def _device_key(runner) -> str:
    return f"{runner.device.backend}:{runner.device.device}"


def build_auto(cfg: Config, registry: Registry, target_path: Path, draft_path: Path | None, loader,
               progress: bool):
    """(target runner, drafter, policy, fallback, plan). `loader(placement, path, role)`
    loads a runner; draft_path is the draft model for kind auto/model."""
    from hetero_sd.drafters import ModelDrafter, NgramDrafter
    from hetero_sd.profiler import auto_plan

    d = cfg.drafter
    plan = auto_plan(target_path, draft_path if d.kind in ("auto", "model") else None,
                     constraints=constraints(cfg, registry), acceptance=dict(cfg.auto.acceptance) or None,
                     k_max=d.k_max, workload=Workload(cfg.auto.prompt_tokens, cfg.generation.max_new_tokens),
                     backends=cfg.auto.backends or None, precisions=cfg.auto.precisions or None,
                     quick=cfg.auto.quick, kv_budget=cfg.memory.kv_budget, progress=progress, registry=registry)
    target = loader(plan.best.target, target_path, "target")

    def make_drafter(candidate):
        if candidate.drafter == "ngram":
            return NgramDrafter(d.min_ngram, d.max_ngram)
        runner = loader(candidate.draft_placement, draft_path, "draft model")
        return ModelDrafter(runner, target.vocab_size, f"draft model {Path(draft_path).name}")

    spec = plan.best if plan.best.k > 0 else None
    if spec is None and d.k == "auto":  # an adaptive k may turn speculation on later
        spec = plan.speculative_for(plan.best.target)
    drafter = None if spec is None else make_drafter(spec)
    if d.k == "auto":
        policy = plan.adaptive_policy()
    else:
        policy = FixedDraftLength(d.k)
    fallback = PlanFallback(plan, lambda placement: loader(placement, target_path, "target"), make_drafter)
    return target, drafter, policy, fallback, plan
