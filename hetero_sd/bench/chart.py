"""The PNG: per prompt kind, each run's tok/s relative to the bench's one
reference run (our first target-only; geometric mean over prompts), one bar
per run, hatched where an output differed from the target-only greedy ids
of its own target placement."""
from __future__ import annotations

from pathlib import Path

from hetero_sd.bench.common import EOS_POLICIES

COLOURS = {"ours": "#1f77b4", "genai": "#ff7f0e", "transformers": "#2ca02c", "llamacpp": "#9467bd"}


def write_png(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    summary = [s for s in report["summary"] if s.get("vs_reference") is not None]
    kinds = list(dict.fromkeys(s["kind"] for s in summary))
    runs = list(dict.fromkeys(s["run"] for s in summary))
    # At least 2 inches high: a single row leaves no room for the title and labels.
    height = max(2.0, 0.9 + 0.32 * len(runs))
    fig, axes = plt.subplots(1, max(1, len(kinds)), figsize=(4 + 3.2 * len(kinds), height), sharey=True,
                             squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        rows = {s["run"]: s for s in summary if s["kind"] == kind}
        for y, name in enumerate(runs):
            s = rows.get(name)
            if s is None:
                continue
            exact = s["identical_to_target_only"] == s["prompts"]
            ax.barh(y, s["vs_reference"], color=COLOURS.get(s["family"], "grey"), hatch="" if exact else "//",
                    edgecolor="black", linewidth=0.4)
            ax.text(s["vs_reference"], y, f" {s['vs_reference']:.2f}x", va="center", fontsize=7)
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_title(f"{kind} prompts")
        ax.set_xlabel(f"tok/s (incl. prefill) / {report['meta']['baseline']}")
        ax.set_xlim(0, max(s["vs_reference"] for s in rows.values()) * 1.25 if rows else 1)
    from matplotlib.patches import Patch

    families = list(dict.fromkeys(s["family"] for s in summary))
    axes[0][-1].legend([Patch(color=COLOURS.get(f, "grey")) for f in families], families, fontsize=7,
                       loc="best")
    axes[0][0].set_yticks(range(len(runs)), runs, fontsize=8)
    axes[0][0].invert_yaxis()
    meta = report["meta"]
    fig.suptitle(f"{meta['model']}: {meta['max_new_tokens']} new tokens, {EOS_POLICIES[meta['eos_policy']]} "
                 "(hatched: output differs from our target-only greedy)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
