"""llama.cpp's own C++ tools as a peer: `llama-bench` on the same GGUF and threads.

llama-cpp-python (llamacpp_peer.py) runs llama.cpp behind Python; its C++
tools are its strongest form, and what a user who picks llama.cpp runs. The
bench runs `llama-bench -p 0 -n N` (decode, N the bench's new tokens) and
`-p 512 -n 0` (prefill) before our runs and again after every peer, so the
figures bracket ours on a host that drifts, and reports their medians beside
our target-only decode tok/s. llama-bench makes its own tokens (no prompt
text), so these are speed figures, not per-prompt rows. How to build the
tools: docs/benchmarks.md.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
from pathlib import Path

from hetero_sd.bench.common import Skip
from hetero_sd.bench.llamacpp_peer import cores as threads  # the cores this process may use, as for the peer
from hetero_sd.errors import ConfigError

PREFILL_TOKENS = 512


def check(binary: Path) -> Path:
    """The llama-bench executable in `binary` (a folder), or a clear error."""
    tool = Path(binary).expanduser() / "llama-bench"
    if not tool.is_file() or not os.access(tool, os.X_OK):
        raise ConfigError(f"--llamacpp-bin: no llama-bench in {binary}: build llama.cpp's tools (docs/benchmarks.md) and pass their "
                   "folder, e.g. --llamacpp-bin ~/.cache/llama.cpp/build/bin")
    return tool


def llama_bench(binary: Path, model: Path, prompt: int, new: int, timeout_s: float = 1800) -> float:
    """tok/s of one llama-bench test (one repetition): prefill when new == 0, else decode."""
    cmd = [str(check(binary)), "-m", str(model), "-t", str(threads()), "-p", str(prompt), "-n", str(new), "-r", "1",
           "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        raise Skip(f"llama-bench failed on {Path(model).name} (exit {out.returncode}): {out.stderr.strip()[-300:]}")
    return float(json.loads(out.stdout)[0]["avg_ts"])


class Bracket:
    """llama-bench figures measured before and after the other runs of a bench."""

    def __init__(self, binary: Path, model: Path, new_tokens: int):
        self.binary, self.model, self.new_tokens = binary, model, new_tokens
        self.decode: list[float] = []
        self.prefill: list[float] = []
        self.errors: list[str] = []  # a failing llama-bench is reported, the bench's other runs kept

    def measure(self) -> None:
        try:
            self.decode.append(llama_bench(self.binary, self.model, 0, self.new_tokens))
            self.prefill.append(llama_bench(self.binary, self.model, PREFILL_TOKENS, 0))
        except (Skip, OSError, subprocess.TimeoutExpired, ValueError, KeyError, IndexError) as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")

    def report(self, ours_decode: list[float], precision: str | None = None) -> dict:
        """The medians, and our target-only decode tok/s (at `precision`) against llama-bench's."""
        out = {"tool": str(check(self.binary)), "threads": threads(), "decode_tok_s": self.decode,
               "prefill_tok_s": self.prefill, "prefill_tokens": PREFILL_TOKENS, "errors": self.errors}
        if not self.decode or not self.prefill:
            return out
        decode = statistics.median(self.decode)
        out |= {"decode_median": decode, "prefill_median": statistics.median(self.prefill)}
        if ours_decode:
            out["ours_target_only_decode_tok_s"] = statistics.median(ours_decode)
            out["ours_precision"] = precision
            out["ours_vs_llamacpp_decode"] = out["ours_target_only_decode_tok_s"] / decode
        return out


def markdown(section: dict) -> list[str]:
    if "decode_median" not in section:
        return ["", f"llama.cpp's C++ `llama-bench` did not run: {'; '.join(section['errors'])}"]
    lines = ["", f"llama.cpp's C++ `llama-bench` on the same GGUF, {section['threads']} threads, measured before our "
             "runs and after the peers: decode " + ", ".join(f"{v:.1f}" for v in section["decode_tok_s"])
             + f" tok/s (median {section['decode_median']:.1f}); prefill of {section['prefill_tokens']} tokens "
             + ", ".join(f"{v:.1f}" for v in section["prefill_tok_s"]) + " tok/s."]
    lines += [f"(a llama-bench run failed: {e})" for e in section["errors"]]
    if "ours_vs_llamacpp_decode" in section:
        lines.append(f"Our target-only decode{_which_model(section.get('ours_precision'))}: "
                     f"{section['ours_target_only_decode_tok_s']:.1f} tok/s (median over prompts), "
                     f"{section['ours_vs_llamacpp_decode']:.2f}x llama-bench's.")
    return lines


# Precisions that quantize the weights again rather than keep the file's blocks: a
# coarser model than the one llama-bench runs (docs/bigger-models.md, "Which model each
# precision is"), so a decode ratio beside llama.cpp's is at unequal quality.
REQUANTIZED = ("int4", "int8")


def _which_model(precision: str | None) -> str:
    if precision in REQUANTIZED:
        return (f" (precision {precision}: the file's weights quantized again, a coarser model than the GGUF "
                "llama-bench runs; benchmarks/check_quality.py measures by how much, precision gguf keeps its "
                "blocks)")
    return f" (precision {precision})" if precision else ""
