"""The spec tree's Ray placements: made from a config's ray sections, and reserved
as one placement group (and given back) around a build.

    ray_placement(section, cluster_keys(cfg))   a ray: section as a RayPlacement
    reserve_places(spec) / release_places(spec) the engine's placement group, when a strategy asks

Reserving talks to the cluster (cluster.ray_env, imported only then); the rest
reads specs and config sections.
"""
from __future__ import annotations

import dataclasses

from hetero_sd.cluster.placement import RayPlacement
from hetero_sd.cluster.sections import CLUSTER_KEYS, RaySection
from hetero_sd.config import Config
from hetero_sd.drafting.specs import DrafterSpec, WorkerSpec, rebuilt, walk


def ray_placement(section: RaySection | None, cluster: dict) -> RayPlacement:
    """A config's ray section (None: the defaults) as the spec tree's RayPlacement,
    with the cluster keys every section shares (`cluster_keys`). A section without
    timeouts (a drafter's: its worker has its own) keeps RayPlacement's."""
    section = section or RaySection()
    timeouts = section.timeouts()

    def node(n) -> RayPlacement:
        return RayPlacement(**cluster, resources=tuple(sorted(n.resources.items())),
                            labels=tuple(sorted(n.labels.items())), node_id=n.node_id, num_cpus=n.num_cpus,
                            num_gpus=n.num_gpus, **timeouts)

    return dataclasses.replace(node(section), fallback=tuple(node(n) for n in section.spares()))


def cluster_keys(cfg: Config) -> dict:
    """address, start_local, namespace and strategy: one engine joins one cluster
    (and reserves one placement group), so a key set in any ray section holds for
    all (load_config refuses two sections that set one differently)."""
    sections = [s.ray for s in (cfg.target, cfg.drafter, *cfg.drafter.stages) if s.process == "ray" and s.ray]
    out = {key: RaySection.model_fields[key].default for key in CLUSTER_KEYS}
    for section in sections:
        out.update({key: getattr(section, key) for key in CLUSTER_KEYS if key in section.model_fields_set})
    return out


def ray_worker(drafter: DrafterSpec | None) -> WorkerSpec | None:
    """The drafter tree's Ray worker (one at most: load_config allows one worker level)."""
    return next((n for n in walk(drafter) if isinstance(n, WorkerSpec) and n.transport == "ray"), None)


def _placements(spec) -> list[RayPlacement]:
    """The target's and the drafter's Ray placements, in that order (an EngineSpec's)."""
    worker = ray_worker(spec.drafter)
    return ([spec.target_ray] if spec.target_ray else []) + ([worker.ray] if worker else [])


def reserve_places(spec):
    """With a ray strategy: the target's and the drafter's Ray placements (of the
    EngineSpec `spec`) reserved together as one placement group (cluster.ray_env.reserve);
    else `spec` as is."""
    placements = _placements(spec)
    if not any(p.strategy for p in placements):
        return spec
    from hetero_sd.cluster.ray_env import reserve

    got = iter(reserve(placements))
    target_ray = next(got) if spec.target_ray else None
    worker = ray_worker(spec.drafter)
    if worker is not None:
        placed = next(got)
        drafter = rebuilt(spec.drafter, lambda n: dataclasses.replace(n, ray=placed) if n is worker else n)
    else:
        drafter = spec.drafter
    return dataclasses.replace(spec, target_ray=target_ray, drafter=drafter)


def release_places(spec) -> None:
    """Give back the placement group reserve_places made (after a failed build)."""
    for placement in _placements(spec):
        if placement.group:
            from hetero_sd.cluster.ray_env import release_group

            release_group(placement.group)
