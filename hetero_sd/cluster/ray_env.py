"""Joining a Ray cluster and turning a RayPlacement into actor options.

One engine process is one Ray driver: the first placement connects, later
ones must name the same cluster. With no cluster at the address, a local one
is started only when the placement says `start_local` (a typo in an address
must not quietly run everything on this machine).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import os

from hetero_sd.cluster.placement import RayPlacement, bundle_of
from hetero_sd.errors import ConfigError

_INSTALL = "pip install 'hetero-sd[ray]' (or: pip install ray)"
_connected: dict = {}  # the address this process joined
_groups = itertools.count()
RESERVE_TIMEOUT_S = 60.0  # the address this process joined, and whether it started the cluster


def require_ray():
    try:
        import ray
    except ImportError:
        raise ConfigError(f"process: ray needs Ray, which is not installed here: {_INSTALL}") from None
    return ray


def connect(placement: RayPlacement):
    """The `ray` module, this process joined to the placement's cluster."""
    ray = require_ray()
    if ray.is_initialized():
        joined = _connected.get("address")
        if joined is not None and placement.address not in (joined, "auto"):
            raise ConfigError(f"ray.address {placement.address!r}: this process already joined the Ray "
                              f"cluster at {joined!r}; every ray section must name the same cluster")
        return ray
    address = None if placement.address == "auto" and not _cluster_running() else placement.address
    if address is None and not placement.start_local:
        raise ConfigError("no Ray cluster is running (RAY_ADDRESS is unset and this host runs no head): "
                          "start one with `ray start --head` (other machines: `ray start --address HEAD:6379`), "
                          "name it in ray.address, or set ray.start_local: true to start one on this machine")
    try:
        ray.init(address=address, namespace=placement.namespace, logging_level=logging.WARNING,
                 log_to_driver=True, include_dashboard=False if address is None else None)
    except ConnectionError as exc:
        auth = "" if os.environ.get("RAY_AUTH_MODE") == "token" else (
            "; if the cluster uses token authentication (Ray >= 2.59 turns it on for clusters started on "
            "one's own machines), set RAY_AUTH_MODE=token here and give this machine the head's token "
            "(~/.ray/auth_token, or RAY_AUTH_TOKEN; `ray get-auth-token` on the head prints it)")
        raise ConfigError(f"ray.address {placement.address!r}: cannot join the Ray cluster: {exc}{auth}") from None
    _connected.update(address=placement.address)
    return ray


def _cluster_running() -> bool:
    """Whether address "auto" finds a cluster: RAY_ADDRESS, or a head started on this host."""
    if os.environ.get("RAY_ADDRESS"):
        return True
    try:
        from ray._private.services import find_gcs_addresses

        return bool(find_gcs_addresses())
    except Exception:  # a private helper: when it moves, let ray.init decide
        return True


def reserve(placements: list[RayPlacement]) -> list[RayPlacement]:
    """One placement group with a bundle for each placement, laid out by their
    strategy; the placements, each now naming its bundle. The group lives as
    long as this process's Ray job (Ray removes it when the driver exits)."""
    strategy = next((p.strategy for p in placements if p.strategy), None)
    if strategy is None:
        return placements
    ray = connect(placements[0])
    from ray.util.placement_group import placement_group, remove_placement_group

    name = f"hetero-sd-{os.getpid()}-{next(_groups)}"
    bundles = [bundle_of(p) for p in placements]
    if not all(bundles):
        raise ConfigError(f"ray.strategy {strategy}: every actor in a placement group must reserve something "
                          "(num_cpus, num_gpus or resources above 0)")
    group = placement_group(bundles, strategy=strategy, name=name)
    ready, _ = ray.wait([group.ready()], timeout=RESERVE_TIMEOUT_S)
    if not ready:
        remove_placement_group(group)
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        raise ConfigError(f"ray.strategy {strategy}: the cluster cannot place bundles {bundles} that way within "
                          f"{RESERVE_TIMEOUT_S:g} s ({len(nodes)} live nodes offering "
                          f"{[_offered(n) for n in nodes]})")
    return [dataclasses.replace(p, group=name, bundle=i) for i, p in enumerate(placements)]


def release_group(name: str) -> None:
    """Remove a placement group reserve() made (its actors go with it); idempotent."""
    import ray
    from ray.util import get_placement_group
    from ray.util.placement_group import remove_placement_group

    if not ray.is_initialized():
        return
    try:
        remove_placement_group(get_placement_group(name))
    except Exception:  # already removed, or the cluster is gone
        pass


def actor_options(placement: RayPlacement) -> dict:
    """`.options(...)` for an actor placed where `placement` says. No restarts:
    a restarted actor has lost its KV and draft state; the engine replaces it."""
    opts: dict = {"num_cpus": placement.num_cpus, "num_gpus": placement.num_gpus, "max_restarts": 0}
    if placement.resources:
        opts["resources"] = dict(placement.resources)
    if placement.labels:
        opts["label_selector"] = dict(placement.labels)
    if placement.node_id:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(placement.node_id, soft=False)
    if placement.group:
        from ray.util import get_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            get_placement_group(placement.group), placement_group_bundle_index=placement.bundle)
    return opts


def check_placeable(placement: RayPlacement, what: str) -> None:
    """Fail now, naming what is available, when no node of the cluster offers the placement."""
    ray = connect(placement)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    fits = [n for n in nodes if _fits(n, placement)]
    if fits or placement.group:  # a reserved bundle: reserve() checked the cluster can hold it
        return
    offered = sorted({k for n in nodes for k in _offered(n)})
    labels = sorted({f"{k}={v}" for n in nodes for k, v in (n.get("Labels") or {}).items()
                     if not k.startswith("ray.io/")})
    raise ConfigError(f"{what}: no live node of the Ray cluster offers {placement.label} "
                      f"(num_cpus {placement.num_cpus:g}, num_gpus {placement.num_gpus:g}); "
                      f"resources offered: {', '.join(offered) or 'none'}; node labels: {', '.join(labels) or 'none'}; "
                      f"nodes: {', '.join(n['NodeID'][:8] for n in nodes)}")


def _offered(node: dict) -> dict:
    """A node's schedulable resources, without Ray's own bookkeeping entries."""
    return {k: v for k, v in node.get("Resources", {}).items()
            if not k.startswith("node:") and k not in ("memory", "object_store_memory")}


def _fits(node: dict, p: RayPlacement) -> bool:
    total = node.get("Resources", {})
    want = dict(p.resources, CPU=p.num_cpus, GPU=p.num_gpus)
    if any(total.get(k, 0.0) < v for k, v in want.items() if v > 0):
        return False
    labels = node.get("Labels") or {}
    if any(labels.get(k) != v for k, v in p.labels):
        return False
    return p.node_id is None or node["NodeID"] == p.node_id


def actor_failure(exc: BaseException) -> bool:
    """Whether `exc` is Ray saying an actor (or its node) is gone."""
    ray = require_ray()
    return isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError))


__all__ = ["actor_failure", "actor_options", "check_placeable", "connect", "release_group", "require_ray", "reserve"]
