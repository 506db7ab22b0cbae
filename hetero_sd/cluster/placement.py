"""Where a Ray actor goes: a frozen, picklable part of the spec tree (imports no ray)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RayPlacement:
    """One actor's placement. `resources` are Ray resources a node must offer
    (custom ones such as {"npu": 1}, set by `ray start --resources`), `labels`
    a node-label selector (`ray start --labels`), `node_id` one node (hard
    affinity). `fallback`, for the target only: placements it moves to, in
    order, when its node or actor dies."""

    address: str = "auto"  # "auto": RAY_ADDRESS or this host's running head; "HOST:PORT"; "ray://HOST:10001"
    start_local: bool = False  # no cluster at `address`: start a one-machine cluster here
    namespace: str = "hetero-sd"
    resources: tuple[tuple[str, float], ...] = ()
    labels: tuple[tuple[str, str], ...] = ()
    node_id: str | None = None
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    timeout_s: float = 60.0  # a target call slower than this means a hung actor (drafters: timeout_s)
    prefill_timeout_s: float = 600.0  # the same for calls longer than a verify (prefills, failover replays)
    fallback: tuple["RayPlacement", ...] = ()
    # One placement group for the engine's actors (PACK, SPREAD, STRICT_PACK, STRICT_SPREAD);
    # once reserved (ray_env.reserve), `group` names it and `bundle` is this actor's place in it.
    strategy: str | None = None
    group: str | None = None
    bundle: int = 0

    @property
    def label(self) -> str:
        where = [f"{k}={v:g}" for k, v in self.resources] + [f"{k}:{v}" for k, v in self.labels]
        if self.node_id:
            where.append(f"node {self.node_id[:8]}")
        if self.group:
            where.append(f"{self.strategy} bundle {self.bundle}")
        return "ray[" + (",".join(where) or "any node") + "]"


def bundle_of(p: RayPlacement) -> dict[str, float]:
    """What an actor placed by `p` reserves: its bundle in a placement group."""
    want = dict(p.resources, CPU=p.num_cpus, GPU=p.num_gpus)
    return {k: float(v) for k, v in want.items() if v > 0}
