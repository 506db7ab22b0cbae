"""From measured runs to figures: per-prompt ratios and token identity, per
kind summaries (geometric means over prompts), the headline comparisons, and
the Markdown table.

A speedup is this run's tok/s over our target-only tok/s on the same prompt,
then the geometric mean over the prompts of a kind: a ratio of two
generations of the same prompt, which is what survives a noisy machine.
"""
from __future__ import annotations

import math
import statistics

from hetero_sd.bench.common import EOS_POLICIES, RunResult

ALL = "all"


def _geo(values) -> float | None:
    values = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    return statistics.geometric_mean(values) if values else None


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token; None when identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(runs: list[RunResult], baseline: str | None) -> list[dict]:
    """Every sample as a dict, with its ratios to the baseline and its token identity. Without
    a baseline (every run that could be one failed) ratios and identity to it are None."""
    by_name = {r.name: {s.id: s for s in r.samples} for r in runs}
    base = by_name.get(baseline, {}) if baseline else {}
    rows = []
    for run in runs:
        own = by_name.get(run.own_greedy or "", {})
        mine = by_name.get(run.baseline, {}) if run.baseline else base
        for s in run.samples:
            b, ref = mine.get(s.id), base.get(s.id)  # ref: the bench's one reference, the same for every row
            row = s.to_dict() | {"run": run.name}
            row["speedup"] = s.tok_s / b.tok_s if b and b.tok_s else None  # vs its own target-only
            row["vs_reference"] = s.tok_s / ref.tok_s if ref and ref.tok_s else None
            row["decode_speedup"] = (s.decode_tok_s / b.decode_tok_s
                                     if b and s.decode_tok_s and b.decode_tok_s else None)
            row["first_difference_vs_target_only"] = first_difference(s.token_ids, b.token_ids) if b else None
            row["identical_to_target_only"] = (row["first_difference_vs_target_only"] is None) if b else None
            row["identical_to_own_greedy"] = (s.token_ids == own[s.id].token_ids) if s.id in own else None
            rows.append(row)
    return rows


def summarize(runs: list[RunResult], rows: list[dict]) -> list[dict]:
    """One entry per (run, kind), kinds in prompt order, plus "all" when there are several kinds."""
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    out = []
    for run in runs:
        mine = [r for r in rows if r["run"] == run.name]
        for kind in kinds + ([ALL] if len(kinds) > 1 else []):
            rs = [r for r in mine if kind in (ALL, r["kind"])]
            if not rs:
                continue
            own = [r["identical_to_own_greedy"] for r in rs if r["identical_to_own_greedy"] is not None]
            out.append({
                "run": run.name, "family": run.family, "kind": kind, "prompts": len(rs),
                "prompt_tokens": _mean(r["prompt_tokens"] for r in rs),
                "new_tokens": _mean(r["new_tokens"] for r in rs),
                "tok_s": _mean(r["tok_s"] for r in rs), "decode_tok_s": _mean(r["decode_tok_s"] for r in rs),
                "prefill_s": _mean(r["prefill_s"] for r in rs),
                "speedup": _geo(r["speedup"] for r in rs), "decode_speedup": _geo(r["decode_speedup"] for r in rs),
                "vs_reference": _geo(r["vs_reference"] for r in rs),
                "acceptance": _acceptance(rs),
                "identical_to_target_only": _count(r["identical_to_target_only"] for r in rs),
                "identical_to_own_greedy": sum(own) if own else None,
                "lossless_settings": run.lossless_settings,
            })
    return out


def _count(flags) -> int | None:
    """How many are True; None when none was compared."""
    flags = [f for f in flags if f is not None]
    return sum(flags) if flags else None


def _acceptance(rs: list[dict]) -> float | None:
    drafted = sum(r["drafted"] or 0 for r in rs if r["drafted"] is not None)
    accepted = sum(r["accepted"] or 0 for r in rs if r["accepted"] is not None)
    return accepted / drafted if drafted else None


def headline(summary: list[dict]) -> list[dict]:
    """Per kind: our best lossless run against each peer group's best, by tok/s over the one
    reference run on the same prompts (so the ratio is ours against theirs, whatever
    target-only each run's own speedup was taken against)."""
    groups = {
        "ours, lossless": lambda s: s["family"] == "ours" and s["identical_to_target_only"] == s["prompts"],
        "GenAI, exact hints, identical to its greedy": lambda s: s["family"] == "genai" and s["lossless_settings"]
        and s["identical_to_own_greedy"] == s["prompts"],
        "GenAI, CPU defaults": lambda s: s["family"] == "genai" and not s["lossless_settings"],
        "transformers": lambda s: s["family"] == "transformers",
        "llama.cpp, identical to its greedy": lambda s: s["family"] == "llamacpp"
        and s["identical_to_own_greedy"] == s["prompts"],
    }
    out = []
    for kind in dict.fromkeys(s["kind"] for s in summary):
        entry = {"kind": kind}
        for group, keep in groups.items():
            best = max((s for s in summary if s["kind"] == kind and keep(s) and s["vs_reference"]),
                       key=lambda s: s["vs_reference"], default=None)
            entry[group] = {"run": best["run"], "vs_reference": best["vs_reference"],
                            "tok_s": best["tok_s"]} if best else None
        ours = entry["ours, lossless"]
        for group in list(groups)[1:]:
            theirs = entry[group]
            entry[f"ours / {group}"] = (ours["vs_reference"] / theirs["vs_reference"]
                                        if ours and theirs else None)
        out.append(entry)
    return out


def _f(value, fmt: str, missing: str = "-") -> str:
    return missing if value is None else format(value, fmt)


def _no_ours(meta: dict) -> str:
    if meta["baseline"] == "ours target-only":
        return ""
    if meta["baseline"] is None:
        return " No run could serve as the reference: no ratios."
    return (f" None of our runs took place (--config none): speedup, vs ref and = target-only are "
            f"against `{meta['baseline']}` instead.")


def to_markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [f"Model {meta['model']}, {meta['prompts']} prompts, {meta['max_new_tokens']} new tokens at most, "
             f"EOS {meta['eos_policy']}d, greedy. Speedup: geometric mean over prompts of tok/s / the tok/s "
             "of our target-only on the same target placement and prompt (for our configurations, run "
             "interleaved with them); vs ref: the same over "
             f"`{meta['baseline']}`, one reference for every row. tok/s counts prefill; decode tok/s excludes "
             "the time to the first token. = target-only / = own greedy: prompts whose output ids equal "
             "our target-only greedy ids / the same runtime's plain greedy ids." + _no_ours(meta), "",
             "| kind | run | new tok | tok/s | decode tok/s | speedup | decode speedup | vs ref | acceptance | "
             "= target-only | = own greedy |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in report["summary"]:
        own = "-" if s["identical_to_own_greedy"] is None else f"{s['identical_to_own_greedy']}/{s['prompts']}"
        same = "-" if s["identical_to_target_only"] is None else f"{s['identical_to_target_only']}/{s['prompts']}"
        lines.append(f"| {s['kind']} | {s['run']} | {_f(s['new_tokens'], '.0f')} | {_f(s['tok_s'], '.1f')} | "
                     f"{_f(s['decode_tok_s'], '.1f')} | {_f(s['speedup'], '.2f')}x | "
                     f"{_f(s['decode_speedup'], '.2f')}x | {_f(s.get('vs_reference'), '.2f')}x | "
                     f"{_f(s['acceptance'], '.0%')} | "
                     f"{same} | {own} |")
    lines += ["", "| kind | best ours (lossless) | best GenAI exact (lossless) | best GenAI defaults | "
              "best transformers | best llama.cpp (= its greedy) |", "|---|---|---|---|---|---|"]
    for h in report["headline"]:
        cells = []
        for group in ("ours, lossless", "GenAI, exact hints, identical to its greedy", "GenAI, CPU defaults",
                      "transformers", "llama.cpp, identical to its greedy"):
            best, ratio = h.get(group), h.get(f"ours / {group}")
            cell = "-" if best is None else f"{best['run']} {best['tok_s']:.1f} tok/s"
            if ratio is not None:
                cell += f"; ours/it {ratio:.2f}x"
            cells.append(cell)
        lines.append(f"| {h['kind']} | " + " | ".join(cells) + " |")
    lines.append("")
    for r in report["runs"]:
        lines.append(f"- {r['name']}: {r['label']} (load {r['load_s']:.1f}s)")
    for name, why in report["skipped"].items():
        lines.append(f"- skipped {name}: {why}")
    if "llamacpp_tools" in report:
        from hetero_sd.bench.llamacpp_tools import markdown

        lines += markdown(report["llamacpp_tools"])
    return "\n".join(lines) + "\n"
