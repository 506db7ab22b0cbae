"""Placement across machines, on Ray (the optional extra `pip install 'hetero-sd[ray]'`).

    RayPlacement(resources=(("draft_node", 1.0),))       where an actor goes (no ray import)
    ray_env.connect(placement)                           join the running cluster (or start one)
    ray_drafter.RayWorker                                 a RemoteDrafter's worker as a Ray actor
    ray_target.RayRunner / target_over_ray(...)           the target as a Ray actor, with spares

The wire is the one the local workers speak: fixed-layout work-IR records
(bytes) as actor-call arguments, draft distributions and logits as numpy
arrays through Ray's object store (zero-copy reads on the same node). A dead
actor or node surfaces as the worker's or the device's failure, and the
engine drops the drafter or moves the target exactly as it does locally.
"""
from hetero_sd.cluster.placement import RayPlacement

__all__ = ["RayPlacement"]
