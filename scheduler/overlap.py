"""Drafting during the verify: whether a request overlaps, and what a round then costs.

While the target verifies round r on an asynchronous device (a CUDA stream, a
fake device with a declared latency), the drafter pre-drafts round r+1 on its
own device after the context round r would leave if every draft were accepted:
the committed tokens, round r's drafts, then a guess of the bonus token and the
next round's drafts. When the verify returns with every draft accepted and the
bonus equal to the guess, round r+1's drafts are ready (a hit) and cost nothing
on the critical path; otherwise the pre-draft is thrown away and round r+1
drafts serially (a miss). A draft's content never changes what the target
commits, so greedy output equals target-only's and sampling keeps the target's
distribution either way (hetero_sd/request.py).

Plain numbers and strings: the scheduler never touches a tensor library.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

OverlapMode = Literal["auto", "on", "off"]  # scheduler.overlap in the YAML


@dataclass(frozen=True)
class OverlapDecision:
    on: bool
    why: str  # one sentence for --explain and `hetero-sd profile`


def same_device(a: str | None, b: str | None) -> bool:
    """Devices compare as backends resolve them: case-insensitive, "cuda" = "cuda:0"."""
    if a is None or b is None:
        return False
    a, b = a.lower(), b.lower()
    return a == b or f"{a}:0" == b or a == f"{b}:0"


def decide(mode: OverlapMode, target_device: str, target_async: bool, draft_device: str | None,
           predrafts: bool) -> OverlapDecision:
    """Whether a request pre-drafts during its verifies.

    target_async: the target's runner declares `asynchronous` (its submit returns before
    the device finishes). draft_device: where the drafter computes (None: it does not
    draft). predrafts: the drafter can draft before the verify returns (a head reads the
    verify's hidden states, so it cannot)."""
    if mode == "off":
        return OverlapDecision(False, "scheduler.overlap is off: draft, then verify, serially")
    if draft_device is None:
        return OverlapDecision(False, "no drafter: nothing to overlap")
    if not predrafts:
        return OverlapDecision(False, "the drafter reads the verify's hidden states (a head), so it cannot "
                                      "draft the next round before the verify returns: serial")
    if mode == "on":
        return OverlapDecision(True, "scheduler.overlap is on: the next round is pre-drafted during each verify")
    if not target_async:
        return OverlapDecision(False, f"the target's runner on {target_device} is synchronous (its calls "
                                      "return when the device is done): serial")
    if same_device(target_device, draft_device):
        return OverlapDecision(False, f"the drafter and the target share {target_device}, which cannot run "
                                      "both at once: serial")
    return OverlapDecision(True, f"the drafter on {draft_device} drafts the next round while the target "
                                 f"verifies on {target_device}")


def hit_rate(alpha: float, k: int) -> float:
    """The chance a pre-draft is used: all k drafts accepted and the bonus guessed
    (per-token acceptance alpha each, the usual i.i.d. model of the cost model)."""
    return alpha ** (k + 1) if k > 0 else 0.0


def round_seconds(verify_s: float, draft_s: float, predraft_s: float, hit: float) -> float:
    """A speculative round's expected seconds with the overlap: the verify and the
    pre-draft run at once (the longer one is waited for), and a miss drafts serially.
    draft_s: drafting k tokens; predraft_s: the pre-draft (k + 1 tokens)."""
    return max(verify_s, predraft_s) + (1.0 - hit) * draft_s


__all__ = ["OverlapDecision", "OverlapMode", "decide", "hit_rate", "round_seconds", "same_device"]
