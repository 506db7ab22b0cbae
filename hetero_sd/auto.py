"""`placement: auto`: from a config with free fields to a plan, and from the
plan to the same spec tree a manual config makes (spec.EngineSpec), plus a
draft-length policy and PlanFallback, which is both the failover chain and
the re-planner on acceptance drift.

A field the YAML sets is pinned; one it leaves out (or sets to "auto") is the
splitter's to choose. The profile behind the plan is measured once per host,
model and precision and cached (hetero_sd/profiler.py), so only the first
automatic run on a machine pays for it.

Every drafter kind is planned and built: ngram, suffix, a draft model, a head
(on its target's placement: it reads the target's hidden states), a hybrid, a
cascade (drafter.stages, each stage pinned by the YAML or placed here) and a
worker (drafter.process: worker, its keys kept from the YAML). The plan's choice
is written back into a manual config (planned_config) that spec_from_config,
the manual path's builder, turns into the spec.
"""
from __future__ import annotations

from dataclasses import replace

import sys

from hetero_sd.assets import head_path, model_path
from hetero_sd.backends.base import Runner
from hetero_sd.config import Config
from hetero_sd.drafting.build import build_for_target
from hetero_sd.drafting.specs import ModelSpec
from hetero_sd.errors import BackendError, ConfigError, ModelLoadError
from hetero_sd.failover import where
from hetero_sd.loading import Loader
from hetero_sd.draft_options import KindInputs, head_fraction
from hetero_sd.profiler import auto_plan
from hetero_sd.scheduler import (AcceptanceTracker, Constraints, FixedDraftLength, Placement, Workload,
                                 replan, replan_if_drifted)
from hetero_sd.spec import head_features, spec_from_config


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


def constraints(cfg: Config, load: Loader) -> Constraints:
    """What the YAML fixes. With drafter.stages the kind is a cascade, its levels pinned
    in KindInputs (kind_inputs); a head's placement is its target's (splitter.pairs_with),
    so the drafter section's keys pin only a draft model (kind auto, model, hybrid over one)."""
    d = cfg.drafter
    kind = "cascade" if d.stages else None if d.kind == "auto" else d.kind
    pins_model = not d.stages and (d.kind in ("auto", "model") or (d.kind == "hybrid" and d.hybrid_with == "model"))
    return Constraints(target=_pinned(cfg.target, load), drafter=kind,
                       draft_placement=_pinned(d, load) if pins_model else None,
                       k=None if d.k == "auto" else d.k)


def _wants(cfg: Config, what: str) -> bool:
    """Whether the drafter section may draft with a head or a draft model ("head", "model")."""
    d = cfg.drafter
    return d.kind in ("auto", what) or (d.kind == "hybrid" and d.hybrid_with == what) or \
        (what == "model" and bool(d.stages) and d.kind in ("auto", "model"))


def kind_inputs(cfg: Config, load: Loader, target_path: str) -> tuple[KindInputs, str | None]:
    """(what the splitter may offer, the draft model's path or None). A head the config
    names (kind head, hybrid over one) that cannot be found is the ConfigError head_path
    raises; with kind auto it is a kind not planned, with why."""
    d = cfg.drafter
    fraction, no_head = None, "drafter.kind names no head"
    if _wants(cfg, "head") and not d.stages:
        try:
            head_path(cfg)
            fraction = head_fraction(load.ir(target_path).config.num_layers)
        except ConfigError as exc:
            if d.kind != "auto":
                raise
            no_head = f"no trained head: {exc}"
    draft_path = model_path(cfg, d.model) if _wants(cfg, "model") else None
    inner = (d.kind,) if d.kind in ("ngram", "suffix", "model") else ("ngram", "suffix", "model")
    workers = any(level.process == "worker" for level in (d, *d.stages))
    fixed = "cascade" if d.stages else None if d.kind == "auto" else d.kind  # (as constraints says)
    return KindInputs(head_fraction=fraction, no_head=no_head, only_workers=workers, inner_kinds=inner,
                      kinds=None if fixed is None else frozenset({fixed}),
                      draft_pin=_pinned(d, load) if d.stages else None,
                      stage_pins=tuple(_pinned(s, load) for s in d.stages)), draft_path


def _head_runtime(cfg: Config, target: Placement) -> dict:
    """Where a head computes beside its target: the drafter section's backend / device /
    precision where a head kind sets them, else torch on the target's device where torch
    can reach it (torch, cuda), onnxruntime beside an onnxruntime target, else torch on cpu."""
    d = cfg.drafter
    given = d.model_fields_set if d.kind in ("head", "hybrid") else set()

    def key(name, default):
        value = getattr(d, name)
        return value if name in given and value != "auto" else default

    backend = key("backend", "onnxruntime" if target.backend == "onnxruntime" else "torch")
    near = target.device if backend == "torch" and target.backend in ("torch", "cuda") else "cpu"
    return {"backend": backend, "device": key("device", near), "precision": key("precision", "default")}


def _at(section, placement: Placement):
    return section.model_copy(update={"backend": placement.backend, "device": placement.device,
                                      "precision": placement.precision})


def _drafter_section(cfg: Config, target: Placement, option) -> dict:
    """The drafter section's keys the option fixes (kind, placements, stages)."""
    d, stages = cfg.drafter, []
    while option.kind == "cascade":  # outermost stage first, as drafter.stages lists them
        stages.append(option.placement)
        option = option.inner
    keys = {"kind": option.kind, "stages": [_at(s, p) for s, p in zip(d.stages, stages)]}
    if option.kind == "hybrid":
        keys["hybrid_with"] = option.via
    if option.kind == "head" or (option.kind == "hybrid" and option.via == "head"):
        keys.update(_head_runtime(cfg, target))
    elif option.placement is not None:  # a draft model (alone, under a hybrid or innermost in a cascade)
        keys.update(backend=option.placement.backend, device=option.placement.device,
                    precision=option.placement.precision)
    return keys


def planned_config(cfg: Config, target: Placement, candidate) -> Config:
    """The manual config a plan's choice amounts to (target placement, drafter kind and
    placements; the YAML's other keys, a worker's included, kept), so that spec_from_config,
    the manual path's builder, makes its spec. candidate None: target-only."""
    d = cfg.drafter
    drafter = d.model_copy(update={"kind": "none", "stages": []}) if candidate is None else \
        d.model_copy(update=_drafter_section(cfg, target, candidate.option))
    return cfg.model_copy(update={"placement": "manual", "target": _at(cfg.target, target), "drafter": drafter})


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
    draft or stage models profiles them once); no drafter is built. If the drafter
    section cannot be planned (a missing draft model or head, an absent backend), the
    target is planned alone, with a warning that it may differ from a speculative run's.
    The spec is spec_from_config's for the config the plan amounts to (planned_config)."""
    d = cfg.drafter
    target_path = model_path(cfg, cfg.target.model)

    def planned(draft_path, rules, inputs):
        return auto_plan(target_path, draft_path, constraints=rules,
                         acceptance=dict(cfg.auto.acceptance) or None, k_max=d.k_max,
                         workload=Workload(cfg.auto.prompt_tokens, cfg.generation.max_new_tokens),
                         backends=cfg.auto.backends or None, precisions=cfg.auto.precisions or None,
                         quick=cfg.auto.quick, kv_budget=cfg.memory.kv_budget, progress=load.progress,
                         registry=load.registry, options=load.options, overlap=cfg.scheduler.overlap, kinds=inputs,
                         stage_models=tuple(model_path(cfg, s.model) for s in d.stages))

    try:
        inputs, draft_path = kind_inputs(cfg, load, target_path)
        plan = planned(draft_path, constraints(cfg, load), inputs)
    except (BackendError, ConfigError, ModelLoadError) as exc:
        if not target_only:
            raise
        print(f"hetero-sd: --target-only: the drafter section cannot be planned ({exc}); the target is "
              "planned alone and may sit elsewhere than a speculative run's", file=sys.stderr)
        plan = planned(None, Constraints(_pinned(cfg.target, load), drafter="none"), None)
    chosen = plan.best if plan.best.k > 0 else None
    if chosen is None and d.k == "auto":  # an adaptive k may turn speculation on later
        chosen = plan.speculative_for(plan.best.target)
    spec = spec_from_config(planned_config(cfg, plan.best.target, None if target_only else chosen))
    fallback = PlanFallback(plan, lambda placement: load(_at_placement(spec.target, placement)),
                            lambda candidate: _drafter_for(cfg, spec.target, candidate, load))
    policy = plan.adaptive_policy() if d.k == "auto" else FixedDraftLength(d.k)
    return spec, policy, fallback, plan


def _at_placement(target: ModelSpec, placement: Placement) -> ModelSpec:
    """The target moved by a failover, still returning the features its drafter reads."""
    return replace(target, backend=placement.backend, device=placement.device, precision=placement.precision)


def _drafter_for(cfg: Config, target: ModelSpec, candidate, load: Loader):
    """The drafter a re-plan or failover switches to; None (keep the current one) for a
    head the loaded target returns no hidden states for (they are chosen at its load)."""
    spec = spec_from_config(planned_config(cfg, candidate.target, candidate)).drafter
    if not set(head_features(spec)) <= set(target.features):
        return None
    # (a draft of another tokenizer is made to draft through the text by build_for_target)
    return build_for_target(spec, target.model, load)
