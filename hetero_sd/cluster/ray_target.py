"""The target model as a Ray actor, with spare placements to move to.

    runner = RayRunner(ModelSpec(..., role="target"), RayPlacement(resources=(("gpu_box", 1.0),)))
    fallback = spare_targets(spec, placement)   # RankedFallback over placement.fallback

RayRunner is a Runner (backends.base) whose calls are RunnerCall records
(ir/work.py) sent to a TargetActor, which holds the real runner, loaded on
its node by the same Loader as a local target. Logits, argmax ids and hidden
states come back as numpy arrays through Ray's object store. Every forward
carries the committed length it starts at and the actor rolls its sequence
back to it first, so a round executed twice leaves the same cache and the
same length (a retried call cannot commit twice).

A dead actor or node, or a call past `timeout_s` (`prefill_timeout_s` for calls
longer than a verify), raises BackendError: the
engine's FailoverRunner then builds the next placement's runner and replays
every live sequence into it (failover.py), exactly as for a local device.
"""
from __future__ import annotations

import os
from functools import partial

from hetero_sd.backends.base import BatchItem, PoolUsage, Runner, run_batch
from hetero_sd.cluster.link import probe_reply
from hetero_sd.cluster.placement import RayPlacement
from hetero_sd.cluster.ray_env import actor_failure, actor_options, check_placeable, connect
from hetero_sd.errors import BackendError
from hetero_sd.ir.errors import from_text
from hetero_sd.ir.work import (ALLOCATE, COPY_PREFIX, FEATURES, FORWARD, GREEDY, LENGTH, MAX_DRAFT_TOKENS,
                               RELEASE, TRUNCATE, RunnerCall)

LOAD_TIMEOUT_S = 1800.0  # a 70B model on a cold disk


class TargetActor:
    """The actor body (wrapped by ray.remote when started)."""

    def __init__(self, spec, cache: str | None = None):
        """spec: the target's ModelSpec, its backend options (plugins included) with it;
        cache: the engine's cache folder where it names one ($HETERO_SD_CACHE)."""
        from hetero_sd.backends.registry import discover
        from hetero_sd.ir.cache import use_root
        from hetero_sd.loading import Loader

        if cache:
            use_root(cache)
        try:
            self.runner, self.error = Loader(discover(spec.options), options=spec.options)(spec), None
        except Exception as exc:  # info() reports it as the same error class
            self.runner, self.error = None, f"{type(exc).__name__}: {exc}"

    def info(self) -> dict:
        if self.error is not None:
            return {"error": self.error}
        r = self.runner
        return {"device": r.device, "precision": r.precision, "vocab_size": r.vocab_size,
                "max_context": r.max_context, "feature_layers": tuple(r.feature_layers),
                "max_batch": r.max_batch, "copy_prefix": r.can_copy_prefix, "where": self.where()}

    def call(self, record: bytes):
        c, r = RunnerCall.unpack(record), self.runner
        if c.op in (FORWARD, GREEDY):
            if r.length(c.seq_id) > c.start:  # executed again: roll back to where it starts
                r.truncate(c.seq_id, c.start)
            method = r.forward if c.op == FORWARD else r.greedy
            return method(c.seq_id, c.tokens, c.start, c.num_logits)
        if c.op == ALLOCATE:
            return r.allocate(c.start)
        if c.op == TRUNCATE:
            return r.truncate(c.seq_id, c.start)
        if c.op == RELEASE:
            return r.release(c.seq_id)
        if c.op == LENGTH:
            return r.length(c.seq_id)
        if c.op == FEATURES:
            return r.take_features(c.seq_id)
        if c.op == COPY_PREFIX:
            return r.copy_prefix(c.seq_id, c.num_logits, c.start)
        raise ValueError(f"unknown runner op {c.op}")

    def batch(self, records: list[bytes]):
        calls = [RunnerCall.unpack(b) for b in records]
        for c in calls:
            if self.runner.length(c.seq_id) > c.start:
                self.runner.truncate(c.seq_id, c.start)
        return run_batch(self.runner, [BatchItem(c.seq_id, c.tokens, c.start, c.num_logits) for c in calls])

    def usage(self) -> PoolUsage:
        return self.runner.usage()

    def where(self) -> str:
        import ray

        return f"node {ray.get_runtime_context().get_node_id()[:8]} pid {os.getpid()}"

    def pid(self) -> int:
        return os.getpid()

    def probe(self, record: bytes, rows: int, vocab: int):
        """The link's cost (cluster/link.py): the record back, and a rows x vocab float64 block."""
        return probe_reply(record, rows, vocab)


class RayRunner(Runner):
    """A Runner whose model runs in a TargetActor placed by `placement`; its optional
    capabilities are the actor's runner's."""

    def __init__(self, spec, placement: RayPlacement):
        from hetero_sd.ir.cache import configured_root

        self.ray = connect(placement)
        check_placeable(placement, spec.role)
        self.placement, self.timeout_s = placement, placement.timeout_s
        self.actor = self.ray.remote(TargetActor).options(**actor_options(placement)).remote(spec, configured_root())
        info = self._get(self.actor.info.remote(), LOAD_TIMEOUT_S)
        if "error" in info:
            self.close()
            raise from_text(info["error"], f"{spec.role} on {placement.label}", BackendError)
        self.device, self.precision = info["device"], info["precision"]
        self.vocab_size, self.max_context = info["vocab_size"], info["max_context"]
        self.location = f"{placement.label} ({info['where']})"
        self.feature_layers, self.max_batch = info["feature_layers"], info["max_batch"]
        self.can_copy_prefix = info["copy_prefix"]

    def _get(self, ref, timeout: float):
        try:
            return self.ray.get(ref, timeout=timeout)
        except self.ray.exceptions.GetTimeoutError:
            self.close()
            raise BackendError(f"the target's Ray actor on {self.placement.label} did not answer within "
                               f"{timeout:g} s; it was stopped") from None
        except Exception as exc:
            cause = getattr(exc, "cause", None)  # a RayTaskError: the runner's own exception
            if not actor_failure(exc) and isinstance(cause, Exception):
                raise cause from None
            self.close()  # the actor may outlive a lost object or a transient error: stop it
            what = "died" if actor_failure(exc) else "failed"
            raise BackendError(f"the target's Ray actor on {self.placement.label} {what}: "
                               f"{type(exc).__name__}: {str(exc)[:500]}") from None

    def _timeout(self, tokens: int) -> float:
        """A verify or decode is bounded by timeout_s; a longer call (a prefill, a replay)
        by prefill_timeout_s, so a long prompt does not get a healthy target killed."""
        return self.placement.prefill_timeout_s if tokens > MAX_DRAFT_TOKENS + 1 else self.timeout_s

    def _call(self, op: int, seq_id: int = 0, tokens=(), start: int = 0, num_logits: int = 0):
        record = RunnerCall(op, seq_id, start, num_logits, [int(t) for t in tokens]).pack()
        return self._get(self.actor.call.remote(record), self._timeout(len(tokens)))

    # ------------------------------------------------------------ the Runner protocol
    def allocate(self, capacity: int) -> int:
        return self._call(ALLOCATE, start=capacity)

    def forward(self, seq_id: int, tokens, start: int, num_logits: int):
        return self._call(FORWARD, seq_id, tokens, start, num_logits)

    def greedy(self, seq_id: int, tokens, start: int, num_logits: int) -> list[int]:
        return [int(t) for t in self._call(GREEDY, seq_id, tokens, start, num_logits)]

    def take_features(self, seq_id: int):
        return self._call(FEATURES, seq_id) if self.feature_layers else None

    def forward_batch(self, items: list[BatchItem]) -> list:
        records = [RunnerCall(FORWARD, i.seq_id, i.start, i.num_logits, [int(t) for t in i.tokens]).pack()
                   for i in items]
        return self._get(self.actor.batch.remote(records), self._timeout(max(len(i.tokens) for i in items)))

    def copy_prefix(self, src_id: int, dst_id: int, length: int) -> None:
        if not self.can_copy_prefix:
            super().copy_prefix(src_id, dst_id, length)
        self._call(COPY_PREFIX, src_id, start=length, num_logits=dst_id)

    def truncate(self, seq_id: int, length: int) -> None:
        self._call(TRUNCATE, seq_id, start=length)

    def length(self, seq_id: int) -> int:
        return self._call(LENGTH, seq_id)

    def release(self, seq_id: int) -> None:
        self._call(RELEASE, seq_id)

    def usage(self) -> PoolUsage:
        return self._get(self.actor.usage.remote(), self.timeout_s)

    def close(self) -> None:
        """Stop the actor (its model's memory goes with it), and give back a placement
        group it was placed in. Idempotent."""
        try:
            self.ray.kill(self.actor, no_restart=True)
        except Exception:  # gone with its node
            pass
        if self.placement.group:
            from hetero_sd.cluster.ray_env import release_group

            release_group(self.placement.group)


def spare_targets(spec, placement: RayPlacement):
    """The Fallback whose next_target builds the target at each of `placement.fallback`,
    in order (each loads when it is needed: a spare holds no memory until then)."""
    from hetero_sd.failover import RankedFallback

    return RankedFallback(targets=[(f"target on {p.label}", partial(RayRunner, spec, p))
                                   for p in placement.fallback])


__all__ = ["RayRunner", "TargetActor", "spare_targets"]
