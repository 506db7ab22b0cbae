"""A config becomes one typed spec tree: where the target runs and what drafts for it.

    EngineSpec(target=ModelSpec(..., role="target"),
               drafter=WorkerSpec(CascadeSpec(NgramSpec(), ModelSpec(... int4)), transport="shm"),
               k="auto", k_max=8)

`spec_from_config` reads a manual placement; placement: auto makes the same
tree from the splitter's plan (auto.py). `build.build` turns either into
runners and drafters. What a config names on disk (models, corpora, heads) is
found by assets.py; its Ray sections become placements in cluster/placing.py.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace

from hetero_sd.assets import head_path, model_path, suffix_corpus
from hetero_sd.cluster import RayPlacement
from hetero_sd.cluster.placing import cluster_keys, ray_placement
from hetero_sd.config import Config
from hetero_sd.drafting.specs import (CascadeSpec, DrafterSpec, HeadSpec, HybridSpec, ModelSpec, NgramSpec,
                                      SuffixSpec, WorkerSpec, walk)
from hetero_sd.errors import ConfigError
from hetero_sd.options import config_options


@dataclass(frozen=True)
class EngineSpec:
    target: ModelSpec
    drafter: DrafterSpec | None  # None: target-only
    k: int | str = 5  # drafts per round, or "auto" (adaptive, up to k_max)
    k_max: int = 8
    target_ray: RayPlacement | None = None  # the target in a Ray actor there (hetero_sd/cluster)


def placed(cfg: Config, section, role: str, vocab: int | None = None) -> ModelSpec:
    """The ModelSpec of a config section with model / backend / device / precision keys,
    with the config's backend options; `vocab`: a draft's section's (the target has none)."""
    return ModelSpec(model_path(cfg, section.model), section.backend, section.device, section.precision,
                     cfg.memory.kv_budget, role, vocab, options=config_options(cfg))


def suffix_spec(cfg: Config) -> SuffixSpec:
    """The suffix drafter the drafter section's suffix_* keys describe."""
    d = cfg.drafter
    return SuffixSpec(d.suffix_max_depth, d.suffix_factor, d.suffix_min_prob, d.suffix_cache_requests,
                      suffix_corpus(cfg))


def _innermost(cfg: Config) -> DrafterSpec:
    """The drafter section's own drafter (what stages, if any, verify)."""
    d = cfg.drafter
    if d.kind == "ngram":
        return NgramSpec(d.min_ngram, d.max_ngram)
    if d.kind == "suffix":
        return suffix_spec(cfg)
    if d.kind == "head":
        return head_spec(cfg)
    if d.kind == "hybrid":
        other = head_spec(cfg) if d.hybrid_with == "head" else _draft_model(cfg)
        return HybridSpec(suffix_spec(cfg), other, d.hybrid_min_match)
    return _draft_model(cfg)


def draft_min_prob(section) -> float | None:
    """DrafterConfig.min_prob as ModelSpec takes it: None for auto."""
    return None if section.min_prob == "auto" else section.min_prob


def _draft_model(cfg: Config) -> ModelSpec:
    return replace(placed(cfg, cfg.drafter, "draft model", cfg.drafter.vocab), min_prob=draft_min_prob(cfg.drafter))


def spec_from_config(cfg: Config, target_only: bool = False) -> EngineSpec:
    """placement: manual. The drafter is the innermost level; each stage (the last
    listed first, stages.0 closest to the target) verifies the level inside it;
    the outermost level with process: worker runs itself and everything inside
    it in one worker (load_config refuses a second worker level).
    target_only: no drafter at all (its model paths are not even resolved)."""
    d = cfg.drafter
    drafter = None
    if d.kind != "none" and not target_only:
        levels = [d] + [d.stages[i] for i in reversed(range(len(d.stages)))]  # innermost first
        worker = max((j for j, level in enumerate(levels) if level.process != "inproc"), default=None)
        drafter = _innermost(cfg)
        default_k = d.k if isinstance(d.k, int) else d.k_max
        for j, level in enumerate(levels):
            if j > 0:
                i = len(d.stages) - j
                drafter = CascadeSpec(drafter, placed(cfg, level, f"drafter.stages.{i}", level.vocab),
                                      k=level.k or default_k)
            if j == worker and level.process == "ray":
                drafter = WorkerSpec(drafter, "ray", level.mode, level.timeout_s, level.start_timeout_s,
                                     level.threads, ray=ray_placement(level.ray, cluster_keys(cfg)))
            elif j == worker:
                drafter = WorkerSpec(drafter, level.transport, level.mode, level.timeout_s, level.start_timeout_s,
                                     level.threads, tuple(level.cpus) if level.cpus else None,
                                     data_plane=level.data_plane)
    target = placed(cfg, cfg.target, "target")
    features = head_features(drafter)
    if features:  # the head reads these layers of the target: its runner returns them
        target = dataclasses.replace(target, features=features)
    target_ray = ray_placement(cfg.target.ray, cluster_keys(cfg)) if cfg.target.process == "ray" else None
    return EngineSpec(target, drafter, d.k, d.k_max, target_ray)


def head_spec(cfg: Config) -> HeadSpec:
    """The drafter section's EAGLE-3 head, checked: its folder exists and reads."""
    from hetero_sd.ir.eagle import HeadConfig

    d, path = cfg.drafter, head_path(cfg)
    try:
        layers = HeadConfig.read(path).feature_layers
    except Exception as exc:
        raise ConfigError(f"{cfg.source}: drafter.head: {exc}") from None
    return HeadSpec(str(path), model_path(cfg, None), d.device, layers, d.backend, d.precision)


def head_features(spec: DrafterSpec | None) -> tuple[int, ...]:
    """The target layers a head in the tree reads (() without one)."""
    return next((node.features for node in walk(spec) if isinstance(node, HeadSpec) and node.features), ())
