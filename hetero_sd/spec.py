"""A config becomes one typed spec tree: where the target runs and what drafts for it.

    EngineSpec(target=ModelSpec(..., role="target"),
               drafter=WorkerSpec(CascadeSpec(NgramSpec(), ModelSpec(... int4)), transport="shm"),
               k="auto", k_max=8)

`spec_from_config` reads a manual placement; placement: auto makes the same
tree from the splitter's plan (auto.py). `build.build` turns either into
runners and drafters.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from pathlib import Path

from hetero_sd.cluster import RayPlacement
from hetero_sd.config import Config, resolve_model
from hetero_sd.drafting.specs import (CascadeSpec, DrafterSpec, HeadSpec, HybridSpec, ModelSpec, NgramSpec,
                                      SuffixSpec, WorkerSpec)
from hetero_sd.errors import ConfigError
from hetero_sd.options import config_options


@dataclass(frozen=True)
class EngineSpec:
    target: ModelSpec
    drafter: DrafterSpec | None  # None: target-only
    k: int | str = 5  # drafts per round, or "auto" (adaptive, up to k_max)
    k_max: int = 8
    target_ray: RayPlacement | None = None  # the target in a Ray actor there (hetero_sd/cluster)


def config_dir(cfg: Config) -> Path | None:
    """The folder relative model paths are resolved against (the YAML's)."""
    return Path(cfg.source).parent if cfg.source != "<defaults>" else None


def model_path(cfg: Config, model: str | None) -> str:
    """A section's model, resolved; None means the target's."""
    return str(resolve_model(model or cfg.target.model, config_dir(cfg)))


def placed(cfg: Config, section, role: str) -> ModelSpec:
    """The ModelSpec of a config section with model / backend / device / precision keys,
    with the config's backend options."""
    return ModelSpec(model_path(cfg, section.model), section.backend, section.device, section.precision,
                     cfg.memory.kv_budget, role, getattr(section, "vocab", None), options=config_options(cfg))


def suffix_spec(cfg: Config) -> SuffixSpec:
    """The suffix drafter the drafter section's suffix_* keys describe."""
    d = cfg.drafter
    return SuffixSpec(d.suffix_max_depth, d.suffix_factor, d.suffix_min_prob, d.suffix_cache_requests,
                      suffix_corpus(cfg))


def default_corpus(target_model: str) -> Path:
    """Where `hetero-sd build-corpus` puts, and `suffix_corpus: auto` finds, a target's corpus."""
    from hetero_sd.ir.cache import cache_dir

    return cache_dir("corpora", Path(target_model)) / "corpus.safetensors"


def packaged_corpus(target_model: str) -> Path:
    """A corpus shipped with the package for a target (hetero_sd/corpora/<file stem>.safetensors)."""
    return Path(__file__).parent / "corpora" / f"{Path(target_model).stem}.safetensors"


def suffix_corpus(cfg: Config) -> str | None:
    """drafter.suffix_corpus as a checked path, or None (none, or auto with none built or shipped)."""
    from hetero_sd.drafting.corpus_file import corpus_info

    choice, target = cfg.drafter.suffix_corpus, model_path(cfg, None)
    if choice == "none":
        return None
    if choice == "auto":
        return next((str(p) for p in (default_corpus(target), packaged_corpus(target)) if p.is_file()), None)
    path = Path(choice).expanduser()
    if not path.is_absolute() and config_dir(cfg) is not None:
        path = config_dir(cfg) / path
    try:
        corpus_info(path)
    except ConfigError as exc:
        raise ConfigError(f"{cfg.source}: drafter.suffix_corpus: {exc}") from None
    return str(path)


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
    return replace(placed(cfg, cfg.drafter, "draft model"), min_prob=draft_min_prob(cfg.drafter))


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
                drafter = CascadeSpec(drafter, placed(cfg, level, f"drafter.stages.{i}"), k=level.k or default_k)
            if j == worker and level.process == "ray":
                drafter = WorkerSpec(drafter, "ray", level.mode, level.timeout_s, level.start_timeout_s,
                                     level.threads, ray=ray_placement(level.ray, cluster_keys(cfg)))
            elif j == worker:
                drafter = WorkerSpec(drafter, level.transport, level.mode, level.timeout_s, level.start_timeout_s,
                                     level.threads, tuple(level.cpus) if level.cpus else None)
    target = placed(cfg, cfg.target, "target")
    features = head_features(drafter)
    if features:  # the head reads these layers of the target: its runner returns them
        target = dataclasses.replace(target, features=features)
    target_ray = ray_placement(cfg.target.ray, cluster_keys(cfg)) if cfg.target.process == "ray" else None
    return EngineSpec(target, drafter, d.k, d.k_max, target_ray)


def ray_placement(section, cluster: dict) -> RayPlacement:
    """A config's ray section (None: the defaults) as the spec tree's RayPlacement,
    with the cluster keys every section shares (`cluster_keys`)."""
    from hetero_sd.cluster.sections import RaySection

    section = section or RaySection()
    timeouts = {name: getattr(section, name, getattr(RayPlacement, name))
                for name in ("timeout_s", "prefill_timeout_s")}

    def node(n) -> RayPlacement:
        return RayPlacement(**cluster, resources=tuple(sorted(n.resources.items())),
                            labels=tuple(sorted(n.labels.items())), node_id=n.node_id, num_cpus=n.num_cpus,
                            num_gpus=n.num_gpus, **timeouts)

    return dataclasses.replace(node(section), fallback=tuple(node(n) for n in getattr(section, "fallback", ())))


def reserve_places(spec: EngineSpec) -> EngineSpec:
    """With a ray strategy: the target's and the drafter's Ray placements reserved
    together as one placement group (cluster.ray_env.reserve); else `spec` as is."""
    worker = ray_worker(spec.drafter)
    placements = ([spec.target_ray] if spec.target_ray else []) + ([worker.ray] if worker else [])
    if not any(p.strategy for p in placements):
        return spec
    from hetero_sd.cluster.ray_env import reserve

    got = iter(reserve(placements))
    target_ray = next(got) if spec.target_ray else None
    drafter = _with_worker(spec.drafter, next(got)) if worker else spec.drafter
    return dataclasses.replace(spec, target_ray=target_ray, drafter=drafter)


def ray_worker(d) -> WorkerSpec | None:
    """The drafter tree's Ray worker (one at most: load_config allows one worker level)."""
    if isinstance(d, WorkerSpec):
        return d if d.transport == "ray" else None
    return ray_worker(d.inner) if isinstance(d, CascadeSpec) else None


def release_places(spec: EngineSpec) -> None:
    """Give back the placement group reserve_places made (after a failed build)."""
    worker = ray_worker(spec.drafter)
    for placement in ([spec.target_ray] if spec.target_ray else []) + ([worker.ray] if worker else []):
        if placement.group:
            from hetero_sd.cluster.ray_env import release_group

            release_group(placement.group)


def _with_worker(d, placement: RayPlacement):
    if isinstance(d, WorkerSpec):
        return dataclasses.replace(d, ray=placement)
    return dataclasses.replace(d, inner=_with_worker(d.inner, placement))


def cluster_keys(cfg: Config) -> dict:
    """address, start_local, namespace and strategy: one engine joins one cluster
    (and reserves one placement group), so a key set in any ray section holds for
    all (load_config refuses two sections that set one differently)."""
    from hetero_sd.cluster.sections import CLUSTER_KEYS, RaySection

    sections = [s.ray for s in (cfg.target, cfg.drafter, *cfg.drafter.stages) if s.process == "ray" and s.ray]
    out = {key: RaySection.model_fields[key].default for key in CLUSTER_KEYS}
    for section in sections:
        out.update({key: getattr(section, key) for key in CLUSTER_KEYS if key in section.model_fields_set})
    return out


def default_head(target_model: str) -> Path:
    """Where `hetero-sd train-head` puts, and `head: auto` finds, the head for a target."""
    from hetero_sd.ir.cache import cache_dir

    return cache_dir("heads", Path(target_model))


def packaged_head(target_model: str) -> Path:
    """Where a head shipped with the package for a target lives (hetero_sd/heads/<file stem>)."""
    return Path(__file__).parent / "heads" / Path(target_model).stem


def head_spec(cfg: Config) -> HeadSpec:
    """The drafter section's EAGLE-3 head, checked: its folder exists and reads."""
    from hetero_sd.ir.eagle import HeadConfig

    d, target = cfg.drafter, model_path(cfg, None)
    if d.head == "auto":  # one trained here first, else the one the package ships
        path = next((p for p in (default_head(target), packaged_head(target)) if (p / "config.json").exists()),
                    None)
        if path is None:
            raise ConfigError(f"{cfg.source}: drafter.head: auto, but no head has been trained for "
                              f"{Path(target).name} yet (looked in {default_head(target)}) and none ships "
                              f"for it; build it once with `hetero-sd train-head --config {cfg.source}`, "
                              "or name a head folder")
    else:
        path = Path(d.head).expanduser()
        if not path.is_absolute() and config_dir(cfg) is not None:
            path = config_dir(cfg) / path
        if not (path / "config.json").exists():
            raise ConfigError(f"{cfg.source}: drafter.head: {d.head!r} is not a head folder "
                              f"(no {path / 'config.json'})")
    try:
        layers = HeadConfig.read(path).feature_layers
    except Exception as exc:
        raise ConfigError(f"{cfg.source}: drafter.head: {exc}") from None
    return HeadSpec(str(path), target, d.device, layers, d.backend, d.precision)


def head_features(spec: DrafterSpec | None) -> tuple[int, ...]:
    """The target layers a head in the tree reads (() without one)."""
    if isinstance(spec, HeadSpec):
        return spec.features
    return next((f for f in map(head_features, getattr(spec, "parts", ())) if f), ())
