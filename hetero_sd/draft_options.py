"""Every drafter kind as the splitter's DraftOptions, from measured profiles.

profiler.build_problem calls `draft_options`; the kinds:
  ngram, suffix  model-free lookups on the host's CPU (one measured lookup a round)
  model          the draft model on each placement it was profiled on
  head           an EAGLE-3 head on each target placement (it reads the target's hidden
                 states there); its step is estimated from the layer count, not measured
  hybrid         suffix where the match is long, else the head or the draft model
  cascade        intermediate models (drafter.stages) verifying the inner drafter, each
                 draft token priced at the stage's own speculative decode time
  worker         the model-free, model and cascade kinds again in their own process, paying
                 the shared-memory ring's round trip each round
A kind that cannot be offered (a head with no trained head, a hybrid with neither a
head nor a draft model) comes back in `unplanned` with why, for Plan.explain().
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from hetero_sd.scheduler import DeviceProfile, DraftOption, Placement, RoundCost
from hetero_sd.scheduler.splitter import matches

DEFAULT_ACCEPTANCE = {"ngram": 0.5, "suffix": 0.55, "model": 0.7, "head": 0.75, "hybrid": 0.75}
# A worker's round trip: the shm ring's control record, p50 on a 2-core host
# (docs/processes-and-ray.md, "What a round trip costs").
WORKER_LINK_S = 1.8e-4


@dataclass(frozen=True)
class KindInputs:
    """What the kinds beyond the lookups need; each absent input is a reason a kind is not planned."""

    drafts: tuple[DeviceProfile, ...] = ()  # the draft model on each placement (as a drafter)
    head_fraction: float | None = None  # a head step as a share of the target's one-token step
    no_head: str = "no trained head was looked for"  # why there is no head (head_fraction None)
    stages: tuple[tuple[DeviceProfile, ...], ...] = ()  # cascade: each stage's profiles, outermost first
    workers: bool = False  # also offer the drafters in a worker process
    only_workers: bool = False  # offer them there only (the config asks for drafter.process: worker)
    # cascade: the kinds its innermost drafter may be (() : the draft model, else the n-gram),
    # where the config pins that draft model, and each stage (outermost first; None: free)
    inner_kinds: tuple[str, ...] = ()
    draft_pin: Placement | None = None
    stage_pins: tuple[Placement | None, ...] = ()
    kinds: frozenset[str] | None = None  # None: every kind the inputs allow
    no_draft: str = "no draft model is configured (drafter.model)"
    extra: tuple[tuple[str, str], ...] = ()  # more (kind, why) from the caller


def head_fraction(target_layers: int) -> float:
    """An EAGLE-3 head is one decoder layer plus the fc and LM head: about two of the
    target's layers' worth of its one-token step (an estimate; explain marks it)."""
    return min(1.0, 2.0 / max(1, target_layers))


def _lookups(alpha: dict, lookup_s: float) -> list[DraftOption]:
    return [DraftOption("ngram", alpha["ngram"], round_s=lookup_s),
            DraftOption("suffix", alpha["suffix"], round_s=lookup_s)]


def _heads(alpha: dict, targets, inputs: KindInputs) -> list[DraftOption]:
    return [DraftOption("head", alpha["head"], t, step_s=t.decode_s * inputs.head_fraction, predrafts=False,
                        estimated=True) for t in targets]


def _hybrids(alpha: dict, heads, models, lookup_s: float) -> list[DraftOption]:
    """Priced as the other drafter plus the lookup (where the suffix drafts, it is cheaper)."""
    return [replace(o, kind="hybrid", alpha=alpha["hybrid"], round_s=o.round_s + lookup_s, via=o.kind)
            for o in (*heads, *models)]


def _step(option: DraftOption, stage: DeviceProfile, k_max: int) -> float:
    """Seconds per token of a stage decoding speculatively with `option` drafting for it."""
    _, rate, _ = RoundCost(stage.verify, option.draft_curve()).best_k(option.alpha, k_max, option.hit_rate, 1)
    return 1.0 / rate


def _cascade_inner(lookups, models, inputs: KindInputs) -> list[DraftOption]:
    """The innermost drafter's options: the kinds the config allows, its draft model
    only where the drafter section pins it."""
    models = [o for o in models if matches(inputs.draft_pin, o.placement)]
    if not inputs.inner_kinds:
        return models or lookups[:1]
    return [o for o in lookups + models if o.kind in inputs.inner_kinds]


def _cascades(alpha: dict, inner: list[DraftOption], stages, k_max: int, pins=()) -> list[DraftOption]:
    """Innermost stage first: each level takes the fastest option inside it; the
    outermost stage is offered on every placement it was profiled on. A stage the
    config pins (pins: outermost first) is offered where it matches only."""
    if not stages or not inner:
        return []
    pins = tuple(pins) + (None,) * (len(stages) - len(pins))
    levels = [[p for p in profiles if matches(pin, p.placement)]
              for profiles, pin in reversed(list(zip(stages, pins)))]  # innermost first
    best = inner
    for profiles in levels[:-1]:
        options = [DraftOption("cascade", alpha["model"], p, step_s=_step(o, p, k_max), via=str(o), inner=o)
                   for p in profiles for o in best]
        best = [min(options, key=lambda o: o.step_s)] if options else []
    return [DraftOption("cascade", alpha["model"], p, step_s=_step(o, p, k_max), via=str(o), inner=o)
            for p in levels[-1] for o in best]


def _workers(options: list[DraftOption]) -> list[DraftOption]:
    """A head (or a hybrid over one) reads the target's hidden states in its process: never a worker."""
    return [replace(o, process="worker", link_s=WORKER_LINK_S) for o in options
            if o.kind in ("ngram", "suffix", "model", "cascade")]


def draft_options(targets: tuple[DeviceProfile, ...], acceptance: dict | None, lookup_s: float,
                  inputs: KindInputs, k_max: int) -> tuple[list[DraftOption], list[tuple[str, str]]]:
    """(options, unplanned (kind, why)) for every drafter kind."""
    alpha = {**DEFAULT_ACCEPTANCE, **(acceptance or {})}
    unplanned = []
    lookups = _lookups(alpha, lookup_s)
    models = [DraftOption("model", alpha["model"], p) for p in inputs.drafts]
    if not models:
        unplanned.append(("model", inputs.no_draft))
    heads = _heads(alpha, targets, inputs) if inputs.head_fraction is not None else []
    if not heads:
        unplanned.append(("head", inputs.no_head))
    hybrids = _hybrids(alpha, heads, models, lookup_s)
    if not hybrids:
        unplanned.append(("hybrid", "it drafts with a head or a draft model where the suffix match is short, "
                                    "and neither is available"))
    cascades = _cascades(alpha, _cascade_inner(lookups, models, inputs), inputs.stages, k_max,
                         inputs.stage_pins)
    if not cascades:
        unplanned.append(("cascade", "no intermediate models are configured (drafter.stages), or none "
                                     "is profiled where the config pins it"))
    options = lookups + models + heads + hybrids + cascades
    if inputs.only_workers:
        options = _workers(options)
        # (the manual path refuses them in a worker too: a head reads the target's hidden states)
        unplanned += [(kind, "drafter.process: worker runs ngram, suffix, model and cascades; a head or "
                             "hybrid drafts in the target's process") for kind in ("head", "hybrid")
                      if any(o.kind == kind for o in heads + hybrids)]
    elif inputs.workers:
        options += _workers(lookups + models + cascades)
    else:
        unplanned.append(("worker", "in-process drafters only here (a worker is offered where "
                                    "drafter.process: worker may be chosen)"))
    if inputs.kinds is not None:  # the caller offers these kinds only and says why not the others (extra)
        options = [o for o in options if o.kind in inputs.kinds]
        unplanned = [(k, why) for k, why in unplanned if k in inputs.kinds]
    return options, unplanned + list(inputs.extra)
