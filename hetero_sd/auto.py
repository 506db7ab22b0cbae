"""`placement: auto`: from a config with free fields to a plan, and from the
plan to the same spec tree a manual config makes (spec.EngineSpec), plus a
draft-length policy and PlanFallback, which is both the failover chain and
the re-planner on acceptance drift.

A field the YAML sets is pinned; one it leaves out (or sets to "auto") is the
splitter's to choose. The profile behind the plan is measured once per host,
model and precision and cached (hetero_sd/profiler.py), so only the first
automatic run on a machine pays for it.
"""
from __future__ import annotations

from dataclasses import replace

import sys

from hetero_sd.assets import model_path
from hetero_sd.backends.base import Runner
from hetero_sd.config import Config
from hetero_sd.drafting.build import build_for_target
from hetero_sd.drafting.specs import ModelSpec, NgramSpec
from hetero_sd.errors import BackendError, ConfigError, ModelLoadError
from hetero_sd.failover import where
from hetero_sd.loading import Loader
from hetero_sd.draft_options import KindInputs
from hetero_sd.profiler import auto_plan
from hetero_sd.scheduler import (AcceptanceTracker, Constraints, FixedDraftLength, Placement, Workload,
                                 replan, replan_if_drifted)
from hetero_sd.options import config_options
from hetero_sd.spec import EngineSpec, draft_min_prob, suffix_spec


def _pinned(section, load: Loader) -> Placement | None:
    """The part of a placement the user fixed, "auto" for the rest."""
    given = section.model_fields_set
    backend = section.backend if "backend" in given and section.backend != "auto" else "auto"
    device = section.device if "device" in given and section.device != "auto" else "auto"
    precision = section.precision if "precision" in given and section.precision != "auto" else "auto"
    if backend != "auto" and device != "auto":
        info, prec = load.check(ModelSpec("", section.backend, section.device, section.precision, role="placement",
                                          options=load.options))
        device = info.device
        precision = prec.name if precision != "auto" else "auto"
    if (backend, device, precision) == ("auto", "auto", "auto"):
        return None
    return Placement(backend, device, precision)


# What plan_engine can build from a plan; the other kinds need placement: manual, which
# load_config enforces (head, hybrid, drafter.stages, drafter.process: worker).
BUILDABLE = frozenset({"ngram", "suffix", "model"})
MANUAL_ONLY = (("head", "placement: auto builds ngram, suffix and model drafters; a head needs placement: "
                        "manual (hetero-sd profile --explain prices it)"),
               ("hybrid", "needs placement: manual, like the head it drafts with"),
               ("cascade", "drafter.stages needs placement: manual"),
               ("worker", "drafter.process: worker needs placement: manual"))


def constraints(cfg: Config, load: Loader) -> Constraints:
    d = cfg.drafter
    return Constraints(target=_pinned(cfg.target, load),
                       drafter=None if d.kind == "auto" else d.kind,
                       draft_placement=_pinned(d, load) if d.kind in ("auto", "model") else None,
                       k=None if d.k == "auto" else d.k)


class PlanFallback:
    """A failover.Fallback and failover.Replanner that follow the plan.

    Failover along the plan's ranking: a failed device is excluded and the
    best remaining candidate takes the role (the target stays put when only
    the drafter failed, so the output stays exact to the same numerics).
    Re-planning: on_round watches acceptance and plans again when it drifts."""

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
        runner = failed.runner  # (Drafter.runner)
        if not isinstance(runner, Runner):  # the n-gram drafter has no device to exclude
            return None
        try:
            self.plan = replan(self.plan, failed=where(runner), keep_target=True)
        except BackendError:
            return None
        spec = self.plan.speculative_for(self.plan.best.target)
        return None if spec is None else self._make_drafter(spec)

    def next_target(self, failed, error):
        key = where(failed)
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


def plan_engine(cfg: Config, load: Loader, target_only: bool = False):
    """(EngineSpec, draft-length policy, PlanFallback, plan) for placement: auto.
    target_only: the full plan's target placement, without its drafter (a baseline
    must run the target the speculative run verifies on, or its outputs are not
    comparable). The plan reads the cached profile (a host that never profiled the
    draft model profiles it once); no draft model is built. If the drafter section
    cannot be planned (a missing draft model, an absent backend), the target is
    planned alone, with a warning that it may differ from a speculative run's."""
    d = cfg.drafter
    target_path = model_path(cfg, cfg.target.model)

    def planned(draft_path, rules):
        return auto_plan(target_path, draft_path, constraints=rules,
                         acceptance=dict(cfg.auto.acceptance) or None, k_max=d.k_max,
                         workload=Workload(cfg.auto.prompt_tokens, cfg.generation.max_new_tokens),
                         backends=cfg.auto.backends or None, precisions=cfg.auto.precisions or None,
                         quick=cfg.auto.quick, kv_budget=cfg.memory.kv_budget, progress=load.progress,
                         registry=load.registry, options=load.options, overlap=cfg.scheduler.overlap,
                         kinds=KindInputs(kinds=BUILDABLE, extra=MANUAL_ONLY if d.kind == "auto" else ()))

    draft_path = None
    try:
        draft_path = model_path(cfg, d.model) if d.kind in ("auto", "model") else None
        plan = planned(draft_path, constraints(cfg, load))
    except (BackendError, ConfigError, ModelLoadError) as exc:
        if not target_only:
            raise
        print(f"hetero-sd: --target-only: the drafter section cannot be planned ({exc}); the target is "
              "planned alone and may sit elsewhere than a speculative run's", file=sys.stderr)
        plan = planned(None, Constraints(_pinned(cfg.target, load), drafter="none"))

    def model_spec(path: str, placement: Placement, role: str) -> ModelSpec:
        return ModelSpec(path, placement.backend, placement.device, placement.precision, cfg.memory.kv_budget, role,
                         options=config_options(cfg))

    def drafter_spec(candidate):
        if candidate.drafter == "ngram":
            return NgramSpec(d.min_ngram, d.max_ngram)
        if candidate.drafter == "suffix":
            return suffix_spec(cfg)
        # (a draft of another tokenizer is made to draft through the text by build_for_target)
        return replace(model_spec(draft_path, candidate.draft_placement, "draft model"), min_prob=draft_min_prob(d))

    fallback = PlanFallback(plan, lambda placement: load(model_spec(target_path, placement, "target")),
                            lambda candidate: build_for_target(drafter_spec(candidate), target_path, load))
    chosen = plan.best if plan.best.k > 0 else None
    if chosen is None and d.k == "auto":  # an adaptive k may turn speculation on later
        chosen = plan.speculative_for(plan.best.target)
    if target_only:
        chosen = None
    spec = EngineSpec(model_spec(target_path, plan.best.target, "target"),
                      None if chosen is None else drafter_spec(chosen), d.k, d.k_max)
    policy = plan.adaptive_policy() if d.k == "auto" else FixedDraftLength(d.k)
    return spec, policy, fallback, plan
