"""`--explain` for a manual placement with Ray actors: where each part runs,
what the link costs per round (measured now), and what the cost model
predicts for drafting across the link, synchronously or ahead, against the
target alone.

The figures are measured on the spot through the engine's own actors: link
round trips (cluster/link.py), the drafter's time for k drafts (its
worker-side compute), and the target's verify of k + 1 tokens (through its
actor, so a target on another node includes its own link).
"""
from __future__ import annotations

import statistics
import time

from hetero_sd.cluster.link import measure_link
from hetero_sd.ir.work import DraftRequest
from hetero_sd.scheduler.cost_model import CostCurve, RoundCost

PROMPT = list(range(3, 35))  # any ids: the timing does not depend on them
ASSUMED_ALPHA = 0.7  # a draft model's typical acceptance; the adaptive k corrects it online


def ray_parts(engine) -> tuple[object | None, object | None]:
    """(target RayRunner or None, RemoteDrafter over Ray or None)."""
    from hetero_sd.cluster.ray_target import RayRunner
    from hetero_sd.drafting.cascade import CascadeDrafter
    from hetero_sd.drafting.remote import RemoteDrafter

    target = engine.target if isinstance(engine.target, RayRunner) else None
    drafter = engine.drafter
    while isinstance(drafter, CascadeDrafter):  # a cascade's inner drafter may be the Ray worker
        drafter = drafter.inner
    return target, drafter if isinstance(drafter, RemoteDrafter) and drafter.transport == "ray" else None


def explain_cluster(engine, k: int, sampled: bool) -> str | None:
    """The explanation, or None when nothing of the engine runs in a Ray actor."""
    target, drafter = ray_parts(engine)
    if target is None and drafter is None:
        return None
    import ray

    lines = [f"placement: manual, on the Ray cluster at {ray.get_runtime_context().gcs_address} "
             f"({sum(n['Alive'] for n in ray.nodes())} live nodes)"]
    t_node = _node(target.actor) if target is not None else _driver_node()
    lines.append(f"  target: {engine.target.device.backend}:{engine.target.device.device} "
                 f"{engine.target.precision.name} on " + (target.location if target else "this process") +
                 (f"; spares: {', '.join(p.label for p in target.placement.fallback)}"
                  if target is not None and target.placement.fallback else ""))
    link = 0.0
    if drafter is not None:
        drafter.wait_ready()
        w = drafter._w
        d_node = _node(w.actor)
        lines.append(f"  drafter: {drafter.spec.label} (mode {drafter.mode}) on {drafter.placement.label} "
                     f"node {d_node[:8]}: " + ("another node than the target" if d_node != t_node
                                               else "the target's node"))
        cost = measure_link(w.actor, drafter.vocab)
        lines.append(f"  link engine <-> drafter: {cost.describe()}")
        link = cost.per_round(sampled)
    if target is not None:
        lines.append(f"  link engine <-> target: {measure_link(target.actor, target.vocab_size).describe()}")
    if drafter is None:
        return "\n".join(lines)
    d, v, v1 = _draft_seconds(drafter, k), _verify_seconds(engine.target, k + 1), _verify_seconds(engine.target, 1)
    model = RoundCost(CostCurve(((1, v1), (k + 1, max(v, v1)))), CostCurve(((k, d),)), link)
    from hetero_sd.scheduler.cost_model import tokens_per_round

    per_round = tokens_per_round(ASSUMED_ALPHA, k)
    rates = {"target alone": 1.0 / model.seconds(0),
             f"draft across the link, sync, k={k}": per_round / model.seconds(k)}
    if not sampled:  # a sampled request drafts on request only: nothing is drafted ahead
        rates[f"draft across the link, async, k={k}"] = per_round / model.seconds_ahead(ASSUMED_ALPHA, k)
    lines.append(f"  measured: D({k}) = {d * 1e3:.2f} ms drafting, V({k + 1}) = {v * 1e3:.2f} ms, "
                 f"V(1) = {v1 * 1e3:.2f} ms verifying, link {link * 1e3:.2f} ms per round "
                 f"({'with' if sampled else 'without'} distributions)")
    lines.append(f"  cost model (acceptance {ASSUMED_ALPHA} assumed): round = D(k) + link + V(k+1) in sync; "
                 "link + V(k+1) + (1 - a^k) D(k) + a^k max(0, D(k) - V(k+1)) when the drafter works ahead")
    for name, rate in sorted(rates.items(), key=lambda kv: -kv[1]):
        lines.append(f"    {rate:8.1f} tokens/s  {name}")
    best = max(rates, key=rates.get)
    share = link / model.seconds(k)
    slow = ""
    if share > 0.2:
        slow = ("; with a link this slow, draft on the target's node (process: worker)" if sampled or
                drafter.mode == "async" else "; with a link this slow, draft ahead (mode: async) or on the "
                "target's node (process: worker)")
    lines.append(f"  advice: {best} is predicted fastest; the link is {share:.0%} of a sync round{slow}")
    return "\n".join(lines)


def _node(actor) -> str:
    import ray

    return ray.get(actor.where.remote(), timeout=60).split()[1]


def _driver_node() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()[:8]


def _draft_seconds(drafter, k: int, repeats: int = 5) -> float:
    """Worker-side seconds for k fresh drafts after a 32-token context: each repeat
    replaces the last token, so a drafter working ahead cannot serve a guess."""
    drafter.begin(len(PROMPT) + k + 1)
    try:
        drafter.draft(DraftRequest(0, 0, k, PROMPT))
        before = drafter.stats.compute_s
        for i in range(repeats):
            drafter.draft(DraftRequest(0, len(PROMPT) - 1, k, [1 + i % 2]))
        return (drafter.stats.compute_s - before) / repeats
    finally:
        drafter.reset()


def _verify_seconds(runner, width: int, repeats: int = 5) -> float:
    seq = runner.allocate(len(PROMPT) + width)
    try:
        runner.forward(seq, PROMPT, 0, 1)
        times = []
        for _ in range(repeats):
            runner.truncate(seq, len(PROMPT))
            t0 = time.perf_counter()
            runner.forward(seq, PROMPT[:width], len(PROMPT), width)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    finally:
        runner.release(seq)


__all__ = ["explain_cluster", "ray_parts"]
