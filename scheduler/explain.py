"""Plan.explain(): a plain-text table of the ranking and the reason for the choice.

Reads a splitter.Plan and its Candidates without importing splitter.py, which
imports this module.
"""
from __future__ import annotations

COLUMNS = ("rank", "target", "drafter", "k", "alpha", "draft ms", "verify ms", "overlap", "tok/round", "round ms",
           "decode tok/s", "tok/s")


def _overlap_cell(c) -> str:
    """yes: pre-drafted during the verify; serial: the pair could but does not overlap; -: no drafter."""
    if c.k == 0 or c.option is None:
        return "-"
    return "yes" if c.overlap.on else "serial"


def _row(plan, rank: int, c) -> tuple[str, ...]:
    alpha = "-" if c.alpha is None else f"{c.alpha:.2f}"
    cost = plan.round_cost(c)  # the measured curves the round is priced from
    draft = "-" if c.k == 0 else f"{cost.draft(c.k) * 1e3:.2f}"
    return (str(rank), str(c.target), c.drafter_label, str(c.k), alpha, draft, f"{cost.verify(c.k + 1) * 1e3:.2f}",
            _overlap_cell(c), f"{c.tokens_per_round:.2f}", f"{c.round_s * 1e3:.2f}",
            f"{c.decode_tokens_per_s:.1f}", f"{c.tokens_per_s:.1f}")


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    left = {1, 2, 7}  # placements (and the overlap word) read better left-aligned
    return ["  ".join(cell.ljust(w) if i in left else cell.rjust(w) for i, (cell, w) in
                      enumerate(zip(row, widths))).rstrip() for row in rows]


def _why(plan) -> list[str]:
    best = plan.best
    lines = []
    if best.k == 0:
        spec = plan.speculative_for(best.target)
        if spec is not None:
            lines.append(f"speculation does not pay on {best.target}: the best drafter ({spec.drafter_label}, "
                         f"k={spec.k}) commits {spec.tokens_per_round:.2f} tokens per round at alpha "
                         f"{spec.alpha:.2f} but a round takes {spec.round_s / best.round_s:.2f}x a decode")
    else:
        decode = next((c for c in plan.ranked if c.target == best.target and c.k == 0), None)
        if decode is not None:
            lines.append(f"{best.drafter_label} with k={best.k} commits {best.tokens_per_round:.2f} tokens "
                         f"per round for {best.round_s / decode.round_s:.2f}x the time of one target decode: "
                         f"{best.decode_tokens_per_s / decode.decode_tokens_per_s:.2f}x target-only decoding")
    if len(plan.ranked) > 1:
        second = plan.ranked[1]
        gap = 1 - second.tokens_per_s / best.tokens_per_s if best.tokens_per_s > 0 else 0.0
        tie = " (a tie, broken by smaller k, drafter kind, then placement name)" if gap == 0 else ""
        lines.append(f"runner-up: {second.drafter_label} k={second.k} on {second.target}, "
                     f"{gap:.1%} slower{tie}")
    return lines


def _overlap_lines(plan) -> list[str]:
    """The chosen plan's overlap and why (overlap.decide's sentence); where it
    overlaps, what the verify hides; where a faster-looking pair could not overlap
    because it shares a device, that it runs serially."""
    spec = plan.best if plan.best.k > 0 else plan.speculative_for(plan.best.target)
    if spec is None:
        return []
    lines = [f"overlap: {'on' if spec.overlap.on else 'serial'}: {spec.overlap.why}"]
    if spec.overlap.on:
        cost = plan.round_cost(spec)
        verify, predraft = cost.verify(spec.k + 1), cost.draft(spec.k + 1)
        hidden = min(predraft, verify) / predraft if predraft > 0 else 1.0
        lines.append(f"overlap: the pre-draft of {spec.k + 1} tokens takes {predraft * 1e3:.2f} ms beside a "
                     f"{verify * 1e3:.2f} ms verify ({hidden:.0%} hidden); a round whose drafts all hold "
                     f"(alpha^(k+1) = {spec.alpha ** (spec.k + 1):.2f}) finds the next drafts ready")
    return lines


def explain(plan) -> str:
    p = plan.problem
    alphas = sorted({(d.kind, d.alpha) for d in p.drafters})
    best = plan.best
    choice = (f"target-only on {best.target}" if best.k == 0 else
              f"{best.drafter_label} k={best.k} drafting for {best.target}")
    head = [f"plan: {choice}, predicted {best.tokens_per_s:.1f} tokens/s",
            "assumed acceptance: " + (", ".join(f"{kind} {a:.2f}" for kind, a in alphas) or "none")
            + f"; k in {'0..' if p.constraints.k is None else ''}"
            + (str(p.k_max) if p.constraints.k is None else f"{p.constraints.k} (fixed)")
            + ("; " + f"per request: {p.workload.prompt_tokens} prompt + {p.workload.new_tokens} new tokens "
               "(tok/s includes prefill)" if p.workload else "; tok/s = steady-state decoding")]
    rows = [COLUMNS] + [_row(plan, i + 1, c) for i, c in enumerate(plan.ranked)]
    body = _table(rows)
    tail = [f"why: {line}" for line in _why(plan)]
    tail += _overlap_lines(plan)
    tail += [f"excluded: {what} ({why})" for what, why in plan.excluded]
    tail += [f"not planned: {kind} ({why})" for kind, why in p.unplanned]
    tail += [f"estimated: {c.drafter_label}'s draft step is an estimate, not a measurement"
             for c in plan.ranked if c.option is not None and c.option.estimated][:1]
    tail.append(f"search: {plan.evaluated} of {plan.exhaustive} (placement, k) points evaluated; "
                "branch and bound on k gives the same choice as trying all")
    return "\n".join(head + body + tail)
