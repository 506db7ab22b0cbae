"""From a validated Config to an Engine's constructor arguments, on one path:

    config --spec_from_config / auto.plan_engine--> EngineSpec --build--> runners + drafter

`build(spec, load)` checks every placement before any model loads (a typo
fails in a second), checks whether every draft model shares the target's
tokenizer (or drafts through the target's text where it does not:
drafting/cross_vocab.py), starts worker drafters, loads the target while they load, and
waits for them. `load` is a loading.Loader: the one way runners are loaded.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from hetero_sd.auto import plan_engine
from hetero_sd.backends.registry import discover
from hetero_sd.backends.threaded import ThreadedRunner
from hetero_sd.cluster.placing import ray_worker, release_places, reserve_places
from hetero_sd.config import Config
from hetero_sd.drafting.base import Drafter
from hetero_sd.drafting.build import build_for_target
from hetero_sd.drafting.specs import WorkerSpec, model_specs
from hetero_sd.errors import ConfigError
from hetero_sd.ir.eog import eog_ids
from hetero_sd.loading import Loader
from hetero_sd.options import config_options
from hetero_sd.scheduler import AdaptiveDraftLength, FixedDraftLength
from hetero_sd.spec import EngineSpec, spec_from_config


@dataclass
class Built:
    target: object  # a Runner
    drafter: Drafter | None
    tokenizer: object
    eos_ids: tuple[int, ...]


def build(spec: EngineSpec, load: Loader) -> Built:
    models = list(model_specs(spec.drafter))
    # Backends and devices of models that load on another node are checked there, at load.
    remote = set(model_specs(ray_worker(spec.drafter)))
    here = ([] if spec.target_ray else [spec.target]) + [m for m in models if m not in remote]
    for model in here:
        load.check(model)
    target_ir = load.ir(spec.target.model)
    tokenizer = load.tokenizer(spec.target.model)
    spec = reserve_places(spec)  # a Ray placement group, when the config asks for one
    drafter = target = None
    try:
        drafter = None if spec.drafter is None else build_for_target(spec.drafter, spec.target.model, load)
        given = split_cores(spec.drafter)  # after the worker started: it pins itself within all CPUs
        if given is not None:  # closing the worker gives this process those CPUs back
            drafter.restore_affinity = given
        target = load_target(spec, load)
        if drafter is not None:
            drafter.wait_ready()
    except BaseException:
        for part in (drafter, target):
            if part is not None:  # (workers and Ray actors hold processes; local parts nothing)
                part.close()
        release_places(spec)
        raise
    # The end-of-generation set (ir/eog.py): the model's eos/eot/eom ids, generation_config.json's,
    # the tokenizer's eos, llama.cpp's end-of-turn texts and the chat template's end of turn.
    return Built(target, drafter, tokenizer, eog_ids(target_ir, tokenizer))


def load_target(spec: EngineSpec, load: Loader):
    """The target's runner: here, or in a Ray actor on the node its placement names."""
    if spec.target_ray is None:
        return load(spec.target)
    from hetero_sd.cluster.ray_target import RayRunner

    return RayRunner(spec.target, spec.target_ray)


def engine_arguments(cfg: Config, progress: bool = False, target_only: bool = False) -> dict:
    """Keyword arguments for Engine(...): everything the config describes, built.
    target_only: the target alone; no drafter is built (no draft model, no worker). With
    placement: auto it is the full plan's target (auto.plan_engine), manual: the section's."""
    options = config_options(cfg)  # the backends' switches (hetero_sd/options.py)
    load = Loader(discover(options), progress=progress, options=options)  # every backend, plugins included
    plan = fallback = None
    if cfg.placement == "auto":
        spec, policy, fallback, plan = plan_engine(cfg, load, target_only=target_only)
    else:
        spec = spec_from_config(cfg, target_only=target_only)
        policy = AdaptiveDraftLength(spec.k_max) if spec.k == "auto" else FixedDraftLength(spec.k)
    built = build(spec, load)
    if threads_target(cfg.scheduler.overlap, spec.drafter, built.target):
        built.target = ThreadedRunner(built.target)
    gen = cfg.generation
    # No re-planner without a drafter: re-planning only swaps drafters (a target failover stays).
    replanner = None if target_only else fallback
    if spec.target_ray is not None and spec.target_ray.fallback:  # spare nodes for the target
        from hetero_sd.cluster.ray_target import spare_targets

        fallback = spare_targets(spec.target, spec.target_ray)
    return dict(target=built.target, drafter=built.drafter, tokenizer=built.tokenizer, eos_ids=built.eos_ids,
                max_new_tokens=gen.max_new_tokens, stop=tuple(gen.stop), chat_template=gen.chat_template,
                sampling=gen.sampling(), policy=policy, fallback=fallback, replanner=replanner, plan=plan,
                constraint=gen.constraint_spec(cfg.source), ignore_eos=gen.ignore_eos,
                overlap=cfg.scheduler.overlap)


def threads_target(overlap: str, drafter, target) -> bool:
    """Whether the target's calls go on a thread of their own (backends/threaded.py), so a
    worker drafts on its cores while this process verifies: always with overlap on; with
    auto where a synchronous worker has cores of its own (a worker drafting ahead by itself,
    mode async, keeps its lookahead)."""
    if target.asynchronous or not isinstance(drafter, WorkerSpec) or drafter.transport == "ray":
        return False
    return overlap == "on" or (overlap == "auto" and bool(drafter.cpus) and drafter.mode == "sync")


def split_cores(drafter) -> set[int] | None:
    """A worker given `cpus` runs there; this process (the target) keeps the
    other CPUs, set before any runtime sizes its thread pool from them. Returns
    the CPUs this process had (None: nothing changed)."""
    cpus = drafter.cpus if isinstance(drafter, WorkerSpec) else None
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return None
    mine = os.sched_getaffinity(0)
    if not set(cpus) <= mine:
        raise ConfigError(f"drafter cpus {sorted(cpus)} are not all available to this process "
                          f"(available: {sorted(mine)})")
    rest = mine - set(cpus)
    if not rest:
        raise ConfigError(f"drafter cpus {sorted(cpus)} leave no CPU for the target (available: {sorted(mine)}); "
                          "give the worker fewer")
    os.sched_setaffinity(0, rest)
    return mine
