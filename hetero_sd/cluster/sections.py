"""The `ray:` sections of a YAML config (hetero_sd/config.py) and the checks
that span them: one engine joins one cluster, with one set of cluster keys."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from hetero_sd.errors import ConfigError

CLUSTER_KEYS = ("address", "start_local", "namespace", "strategy")  # shared by every ray section


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RayNode(_Section):
    """Which node of a Ray cluster an actor goes to: one offering these Ray
    resources (`ray start --resources`), carrying these labels (`ray start
    --labels`), or with this node id; and what the actor reserves there."""

    resources: dict[str, Annotated[float, Field(gt=0)]] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)
    node_id: str | None = None
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)


class RaySection(RayNode):
    """process: ray. The cluster to join and where on it (hetero_sd/cluster)."""

    # "auto": RAY_ADDRESS or the head started on this host; or "HOST:6379"; or "ray://HOST:10001"
    address: str = "auto"
    start_local: bool = False  # no cluster at `address`: start a one-machine cluster here
    namespace: str = "hetero-sd"
    # Reserve the target's and the drafters' places together, as one Ray placement group:
    # STRICT_SPREAD (each on its own node), SPREAD, PACK, STRICT_PACK (all on one node).
    # Places are then chosen by resources, num_cpus and num_gpus (not labels or node_id).
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] | None = None

    def timeouts(self) -> dict[str, float]:
        """The actor's call timeouts this section sets (a drafter's worker has its own: none)."""
        return {}

    def spares(self) -> list[RayNode]:
        """Where the actor moves when its node dies, in order (the target's only)."""
        return []


class TargetRaySection(RaySection):
    timeout_s: Annotated[float, Field(gt=0)] = 60.0  # a slower verify or decode call means a hung actor
    # the same for longer calls: a long prompt's prefill, the replay after a failover
    prefill_timeout_s: Annotated[float, Field(gt=0)] = 600.0
    # Spare placements, in order: where the target moves (its sequences replayed) when
    # its node or actor dies. Each loads only when it is needed.
    fallback: list[RayNode] = Field(default_factory=list)

    def timeouts(self) -> dict[str, float]:
        return dict(timeout_s=self.timeout_s, prefill_timeout_s=self.prefill_timeout_s)

    def spares(self) -> list[RayNode]:
        return self.fallback


def check_ray(cfg, path: Path) -> None:
    """What no single section can check: the target's keys, the cluster keys
    across sections, placement groups against pinned nodes, GPUs."""
    t = cfg.target
    if "ray" in t.model_fields_set and t.process != "ray":
        raise ConfigError(f"{path}: target.ray places the target in a Ray actor; it needs target.process: ray")
    if t.process == "ray" and cfg.placement == "auto":
        raise ConfigError(f"{path}: target.process: ray needs placement: manual (the splitter plans one host)")
    rays = [(key, s) for key, s in (("target", t), ("drafter", cfg.drafter),
                                     *((f"drafter.stages.{i}", s) for i, s in enumerate(cfg.drafter.stages)))
            if s.process == "ray"]
    sections = [(key, s.ray) for key, s in rays if s.ray is not None]
    for name in CLUSTER_KEYS:
        values = {repr(getattr(r, name)): key for key, r in sections if name in r.model_fields_set}
        if len(values) > 1:
            raise ConfigError(f"{path}: ray.{name} differs between {' and '.join(sorted(values.values()))} "
                              f"({', '.join(sorted(values))}); one engine joins one Ray cluster, so set it once")
    for key, r in sections:
        if r.start_local and r.address != "auto":
            raise ConfigError(f"{path}: {key}.ray.start_local starts a cluster when address: auto finds none; "
                              f"it cannot go with address {r.address!r}")
    if any(r.strategy for _, r in sections):
        for key, r in sections:
            pinned = [n for n in ("labels", "node_id") if n in r.model_fields_set]
            if pinned:
                raise ConfigError(f"{path}: {key}.ray.{pinned[0]} cannot place an actor inside a placement "
                                  "group (ray.strategy): bundles are matched by resources, num_cpus and num_gpus")
    for key, section in rays:
        _check_gpu(key, section, path)


def _check_gpu(key: str, section, path: Path) -> None:
    """Ray hands an actor the GPUs it reserved, renumbered from 0 (CUDA_VISIBLE_DEVICES)."""
    device = section.device
    gpus = section.ray.num_gpus if section.ray is not None else 0
    if not device.startswith("cuda"):
        return
    if gpus <= 0:
        raise ConfigError(f"{path}: {key}.device: {device} in a Ray actor needs {key}.ray.num_gpus (>= 1): "
                          "Ray shows an actor only the GPUs it reserved")
    index = device.partition(":")[2] or "0"
    if not index.isdigit() or int(index) >= gpus:
        raise ConfigError(f"{path}: {key}.device: {device}: Ray numbers an actor's reserved GPUs from 0, so "
                          f"with num_gpus {gpus:g} use cuda:0" + (f"..cuda:{int(gpus) - 1}" if gpus >= 2 else ""))
