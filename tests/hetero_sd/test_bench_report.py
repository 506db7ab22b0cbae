"""Bench arithmetic on hand-made samples: ratios per prompt, geometric means
per kind, token identity against target-only and each runtime's own greedy."""
from __future__ import annotations

import math

import pytest

from hetero_sd.bench.common import RunResult, Sample, Workload
from hetero_sd.bench.report import compare, first_difference, headline, summarize, to_markdown


def _run(name, family, per_prompt, own=None, lossless=True):
    """per_prompt: {id: (kind, ids, total_s, prefill_s, drafted, accepted)}"""
    return RunResult(name, family, name, own_greedy=own or name, lossless_settings=lossless,
                     samples=[Sample(i, k, 5, ids, t, p, "length", d, a)
                              for i, (k, ids, t, p, d, a) in per_prompt.items()])


BASE = _run("ours target-only", "ours", {"g1": ("grounded", [1, 2, 3, 4], 1.0, 0.1, None, None),
                                         "g2": ("grounded", [5, 6, 7, 8], 2.0, 0.2, None, None),
                                         "o1": ("open", [9, 9, 9, 9], 1.0, 0.1, None, None)})
SPEC = _run("ours ngram", "ours", {"g1": ("grounded", [1, 2, 3, 4], 0.5, 0.1, 6, 3),
                                   "g2": ("grounded", [5, 6, 7, 8], 0.5, 0.2, 4, 4),
                                   "o1": ("open", [9, 9, 9, 9], 2.0, 0.1, 2, 0)}, own="ours target-only")
PEER = _run("peer plain", "genai", {"g1": ("grounded", [1, 2, 0, 4], 0.25, 0.1, None, None),
                                    "g2": ("grounded", [5, 6, 7, 8], 1.0, 0.2, None, None),
                                    "o1": ("open", [9, 9, 9], 1.0, 0.1, None, None)})
PEER_PL = _run("peer lookup", "genai", {"g1": ("grounded", [1, 2, 0, 4], 0.5, 0.1, None, None),
                                        "g2": ("grounded", [5, 6, 7, 0], 1.0, 0.2, None, None),
                                        "o1": ("open", [9, 9, 9], 1.0, 0.1, None, None)}, own="peer plain")


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_per_prompt_ratios_and_identity():
    rows = {(r["run"], r["id"]): r for r in compare([BASE, SPEC, PEER, PEER_PL], "ours target-only")}
    assert rows[("ours ngram", "g1")]["speedup"] == pytest.approx(2.0)  # 4/0.5 over 4/1.0
    assert rows[("ours ngram", "g1")]["decode_speedup"] == pytest.approx((3 / 0.4) / (3 / 0.9))
    assert rows[("peer plain", "g1")]["identical_to_target_only"] is False
    assert rows[("peer plain", "g1")]["first_difference_vs_target_only"] == 2
    assert rows[("peer plain", "o1")]["identical_to_target_only"] is False  # shorter is not identical
    assert rows[("peer plain", "g2")]["identical_to_target_only"] is True
    assert rows[("peer lookup", "g1")]["identical_to_own_greedy"] is True  # same wrong ids as its greedy
    assert rows[("peer lookup", "g2")]["identical_to_own_greedy"] is False
    assert rows[("peer plain", "o1")]["speedup"] == pytest.approx(3.0 / 4.0)


def test_summary_geometric_means_and_counts():
    runs = [BASE, SPEC, PEER, PEER_PL]
    summary = {(s["run"], s["kind"]): s for s in summarize(runs, compare(runs, "ours target-only"))}
    g = summary[("peer plain", "grounded")]
    assert g["speedup"] == pytest.approx(math.sqrt(4.0 * 2.0))  # ratios 4x and 2x
    assert g["identical_to_target_only"] == 1 and g["prompts"] == 2
    assert summary[("ours ngram", "grounded")]["acceptance"] == pytest.approx(7 / 10)  # pooled over prompts
    assert summary[("ours ngram", "all")]["prompts"] == 3
    assert summary[("ours ngram", "all")]["speedup"] == pytest.approx((2.0 * 4.0 * 0.5) ** (1 / 3))
    assert summary[("peer lookup", "grounded")]["identical_to_own_greedy"] == 1
    assert summary[("ours target-only", "open")]["acceptance"] is None


def test_headline_picks_lossless_bests():
    timing = {s.id: (s.kind, s.token_ids, s.total_s, s.prefill_s, None, None) for s in PEER.samples}
    peer_default = _run("peer default", "genai", timing, lossless=False)
    exact = {i: (k, BASE.samples[n].token_ids, t * 2, p, d, a) for n, (i, (k, ids, t, p, d, a)) in
             enumerate(timing.items())}
    peer_exact = _run("peer exact", "genai", exact)  # half as fast, identical to its own greedy
    runs = [BASE, SPEC, peer_default, peer_exact]
    summary = summarize(runs, compare(runs, "ours target-only"))
    h = {e["kind"]: e for e in headline(summary)}["grounded"]
    assert h["ours, lossless"]["run"] == "ours ngram"
    assert h["GenAI, CPU defaults"]["run"] == "peer default"
    assert h["GenAI, exact hints, identical to its greedy"]["run"] == "peer exact"
    # ours: ratios 2x, 4x; peer default: 4x, 2x; peer exact: 2x, 1x (geometric means over the 2 prompts)
    assert h["ours, lossless"]["vs_reference"] == pytest.approx(math.sqrt(8.0))
    assert h["ours / GenAI, CPU defaults"] == pytest.approx(1.0)
    assert h["ours / GenAI, exact hints, identical to its greedy"] == pytest.approx(2.0)
    md = to_markdown({"meta": {"model": "m", "prompts": 3, "max_new_tokens": 4, "eos_policy": "ignore",
                               "baseline": "ours target-only"}, "summary": summary, "headline": headline(summary),
                      "runs": [], "skipped": {"x": "why"}})
    assert "| grounded | peer default | 4 |" in md and "- skipped x: why" in md


def test_workload_strips_only_a_trailing_eos_when_stopping():
    stop = Workload([], {}, [], 8, "stop", (2,))
    assert stop.strip_eos([5, 6, 2]) == ([5, 6], "eos")
    assert stop.strip_eos([5, 2, 6]) == ([5, 2, 6], "length")
    ignore = Workload([], {}, [], 8, "ignore", (2,))
    assert ignore.strip_eos([5, 6, 2]) == ([5, 6, 2], "length") and ignore.stop_ids == ()


def test_paired_baseline_divides_its_own_run():
    """A later configuration's ratio uses the target-only interleaved with it, not the first one."""
    paired = _run("ours k2 / paired target-only", "ours", {"g1": ("grounded", [1, 2, 3, 4], 2.0, 0.1, None, None),
                                                           "g2": ("grounded", [5, 6, 7, 8], 4.0, 0.2, None, None),
                                                           "o1": ("open", [9, 9, 9, 9], 2.0, 0.1, None, None)})
    paired.hidden = True
    later = _run("ours k2", "ours", {"g1": ("grounded", [1, 2, 3, 4], 1.0, 0.1, 6, 3),
                                     "g2": ("grounded", [5, 6, 7, 8], 1.0, 0.2, 4, 4),
                                     "o1": ("open", [9, 9, 9, 9], 2.0, 0.1, 2, 0)}, own="ours target-only")
    later.baseline = paired.name
    rows = {(r["run"], r["id"]): r for r in compare([BASE, paired, later], "ours target-only")}
    assert rows[("ours k2", "g1")]["speedup"] == pytest.approx(2.0)  # 4/1.0 over 4/2.0, not over 4/1.0
    assert rows[("ours k2", "g2")]["speedup"] == pytest.approx(4.0)
    assert rows[("ours k2", "g1")]["identical_to_target_only"] is True  # identity still vs the baseline
    assert rows[("ours k2", "g1")]["vs_reference"] == pytest.approx(1.0)  # 4/1.0 over the reference's 4/1.0
    # The headline ranks by the one reference, not by speedups over different baselines:
    # k2's own speedup (2x, 4x) beats SPEC's (2x, 4x over BASE) only in appearance.
    summary = summarize([BASE, SPEC, later], compare([BASE, paired, SPEC, later], "ours target-only"))
    h = {e["kind"]: e for e in headline(summary)}["grounded"]
    assert h["ours, lossless"]["run"] == "ours ngram"  # 8 and 8 tok/s beat k2's 4 and 4


def test_without_our_runs_the_first_peer_plain_is_the_reference():
    """--config none: ratios and identity are against the first peer's plain greedy; with no
    possible reference (every plain run failed) rows keep their figures and ratios are None."""
    from hetero_sd.bench.runner import reference

    lookup = _run("llamacpp prompt-lookup", "llamacpp", {"g1": ("grounded", [1, 2, 3, 4], 0.5, 0.1, 6, 3)},
                  own="llamacpp plain")
    plain = _run("llamacpp plain", "llamacpp", {"g1": ("grounded", [1, 2, 3, 4], 1.0, 0.1, None, None)})
    assert reference([BASE, plain, lookup]) == "ours target-only"
    assert reference([lookup, plain]) == "llamacpp plain" and reference([lookup]) is None
    rows = {r["run"]: r for r in compare([plain, lookup], "llamacpp plain")}
    assert rows["llamacpp prompt-lookup"]["vs_reference"] == pytest.approx(2.0)
    assert rows["llamacpp prompt-lookup"]["identical_to_target_only"] is True
    (row,) = compare([lookup], None)
    assert row["speedup"] is row["vs_reference"] is row["identical_to_target_only"] is None
    assert row["identical_to_own_greedy"] is None and row["tok_s"] == pytest.approx(8.0)
    summary = summarize([lookup], [row])
    assert summary[0]["identical_to_target_only"] is None and summary[0]["acceptance"] == pytest.approx(0.5)
    md = to_markdown({"meta": {"model": "m", "prompts": 1, "max_new_tokens": 4, "eos_policy": "ignore",
                               "baseline": None}, "summary": summary, "headline": headline(summary),
                      "runs": [], "skipped": {}})
    assert "| grounded | llamacpp prompt-lookup | 4 | 8.0 |" in md and "| - | - |" in md
    assert "No run could serve as the reference" in md


def test_headline_has_llamacpp_identical_to_its_greedy():
    plain = _run("llamacpp plain", "llamacpp", {s.id: (s.kind, s.token_ids, 2.0, 0.1, None, None)
                                                for s in BASE.samples})
    fast = _run("llamacpp prompt-lookup", "llamacpp", {s.id: (s.kind, [0], 0.1, 0.05, 4, 0) for s in BASE.samples},
                own="llamacpp plain")  # faster, but not its greedy's output: not in the headline
    runs = [BASE, plain, fast]
    summary = summarize(runs, compare(runs, "ours target-only"))
    h = {e["kind"]: e for e in headline(summary)}["grounded"]
    assert h["llama.cpp, identical to its greedy"]["run"] == "llamacpp plain"
    # ours (the target-only, 4 and 2 tok/s) over it (2 and 2 tok/s): geometric mean of 2x and 1x
    assert h["ours / llama.cpp, identical to its greedy"] == pytest.approx(math.sqrt(2.0))
    md = to_markdown({"meta": {"model": "m", "prompts": 3, "max_new_tokens": 4, "eos_policy": "ignore",
                               "baseline": "ours target-only"}, "summary": summary, "headline": headline(summary),
                      "runs": [], "skipped": {}})
    assert "best llama.cpp (= its greedy) |" in md and "llamacpp plain 2.0 tok/s" in md
