"""What happens when a device fails mid-generation: wrappers around the Runner
and the Drafter, so the engine's round loop never sees a failure.

A failing drafter costs speed, never output: FailoverDrafter drops it for the
rest of the request (its draft is empty) and asks the Fallback for a
replacement, which starts from the whole committed context. A failing target
is replaced by FailoverRunner with the Fallback's next runner, which replays
every live sequence into its own cache: the tokens at the positions the
failed one held, the first call's as a prefill and the rest as one
verify-shaped call, so a batch-invariant replacement continues
token-identically. With no replacement
left, the call raises GenerationError and the engine attaches the output so
far.

Failover persists, by design: a replacement serves later requests too (a dead
device is not tried again); `Engine.target` / `Engine.drafter` name the live
ones. A drafter dropped without a replacement is tried again at the next
request (a worker drafter restarts its process). Each wrapper keeps the events
it caused until the engine takes them into the request's stats.

Re-planning on acceptance drift (placement: auto) is the Replanner
interface, called by FailoverDrafter.observe after every speculative round.

    failover/fallback.py  Fallback, Replanner, NoFallback, RankedFallback, where
    failover/runner.py    FailoverRunner
    failover/drafter.py   FailoverDrafter
"""
from hetero_sd.failover.drafter import FailoverDrafter
from hetero_sd.failover.fallback import (Fallback, NoFallback, RankedFallback, Replanner, is_device_failure,
                                         where)
from hetero_sd.failover.runner import FailoverRunner

__all__ = ["Fallback", "Replanner", "NoFallback", "RankedFallback", "FailoverDrafter", "FailoverRunner",
           "is_device_failure", "where"]
