"""Which exact kernel path a quantized graph runs on this host: timed once, cached.

A quantized model may have more than one exact way to run its linear layers on
the CPU: onnxruntime's MatMulNBits (padded as its row check says, row_check.py)
and our own BlockMatMul / GGUFMatMul (never padded). Which is faster depends on
the host (AVX2 only, AVX-512 with VNNI, AMX), the model's shapes and the call's
width, so it is measured, not assumed: on a 2-core AMD EPYC with AVX-512,
MatMulNBits was the faster for SmolLM2 int4's blocks of 32 and ours for the
1.5B's blocks of 128, where MatMulNBits pads odd calls.

Each candidate that is exact here (its row check passed) is timed on the
loaded model itself: a one-token step and a VERIFY_ROWS-row verify after a
CONTEXT-token prefix, each the best of REPEATS (this host is shared and noisy;
the minimum is the figure least disturbed). The one whose step plus verify is
the lower runs: the step is what target-only decode pays, the verify what a
speculative round pays. The choice and its figures are cached (ir.cache) under
the host's signature, both runtimes and the model's lowering (not its graphs'
extra outputs: ort_backend.OrtRunner._choice_folder), so a later load opens the
chosen graph at once; `hetero-sd devices` lists the choices,
`kernel_choice` (and so `hetero-sd profile`) says which runs and why.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hetero_sd.backends.row_check import host_signature

CHOICE_VERSION = 1  # bumped when the timing changes: old choices miss
CONTEXT = 64  # tokens before the timed calls
VERIFY_ROWS = 5  # a verify of four drafts and the bonus row
REPEATS = 5
_FILE = "kernel_choice.json"


@dataclass(frozen=True)
class Timing:
    """One candidate's figures, seconds: a one-token step and a VERIFY_ROWS-row verify."""
    name: str
    step_s: float
    verify_s: float

    @property
    def cost(self) -> float:
        return self.step_s + self.verify_s

    def describe(self) -> str:
        return f"{self.name} {self.step_s * 1e3:.2f}/{self.verify_s * 1e3:.2f} ms"


@dataclass(frozen=True)
class Choice:
    chosen: str
    timings: tuple[Timing, ...]
    how: str  # "timed" | "cached"

    def describe(self) -> str:
        figures = ", ".join(t.describe() for t in sorted(self.timings, key=lambda t: t.cost))
        return f"{self.how} on this host: {figures} (one row / {VERIFY_ROWS} rows)"


def time_runner(runner, repeats: int = REPEATS) -> tuple[float, float]:
    """(one-token step, VERIFY_ROWS-row verify) of a loaded runner, seconds, each the
    best of `repeats` after one warm-up; its calls padded as the runner pads them. The
    sequence it uses is released: the runner is left as it was."""
    rng = np.random.default_rng(20261206)
    tokens = rng.integers(0, runner.vocab_size, CONTEXT + VERIFY_ROWS).tolist()
    seq = runner.allocate(CONTEXT + VERIFY_ROWS + 2)
    try:
        runner.greedy(seq, tokens[:CONTEXT], 0, 1)

        def timed(rows: int) -> float:
            runner.truncate(seq, CONTEXT)
            t0 = time.perf_counter()
            runner.greedy(seq, tokens[CONTEXT:CONTEXT + rows], CONTEXT, rows)
            return time.perf_counter() - t0

        timed(1), timed(VERIFY_ROWS)  # warm-up: a runtime may pick kernels per shape at a first call
        steps, verifies = [], []
        for _ in range(repeats):  # alternated, so a slow spell of the host touches both alike
            steps.append(timed(1))
            verifies.append(timed(VERIFY_ROWS))
        return min(steps), min(verifies)
    finally:
        runner.release(seq)


def choose(timings: list[Timing]) -> Choice:
    """The lowest step plus verify; a tie goes to the first candidate."""
    best = min(timings, key=lambda t: t.cost)
    return Choice(best.name, tuple(timings), "timed")


def cached_choice(folder: Path | None, names: tuple[str, ...]) -> Choice | None:
    """The choice cached in `folder` among exactly these candidates; None: time them."""
    got = _read(folder)
    if got is None or sorted(got["names"]) != sorted(names):
        return None
    return _cached(got)


def _cached(got: dict) -> Choice:
    return Choice(got["chosen"], tuple(Timing(*t) for t in got["timings"]), "cached")


def write_choice(folder: Path | None, choice: Choice, label: str) -> None:
    if folder is None:
        return
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / _FILE
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"chosen": choice.chosen, "names": [t.name for t in choice.timings],
                               "timings": [[t.name, t.step_s, t.verify_s] for t in choice.timings],
                               "host": host_signature(), "label": label}))
    os.replace(tmp, path)


def _read(folder: Path | None) -> dict | None:
    path = None if folder is None else folder / _FILE
    if path is None or not path.exists():
        return None
    try:
        got = json.loads(path.read_text())
        if got["chosen"] in got["names"] and all(len(t) == 3 for t in got["timings"]):
            return got
    except (OSError, ValueError, KeyError, TypeError):
        pass  # a broken entry: time again
    return None


def cached_choices(root: Path) -> list[tuple[str, Choice]]:
    """(label, choice) cached under `root` for this host, the latest of each label (an
    earlier graph version's or runtime's choice is stale, not a second answer), sorted."""
    host, latest = host_signature(), {}
    for path in sorted(root.glob(f"*/{_FILE}"), key=lambda p: p.stat().st_mtime_ns):
        got = _read(path.parent)
        if got is not None and got.get("host") == host:
            latest[got.get("label") or path.parent.name] = _cached(got)
    return sorted(latest.items(), key=lambda item: item[0])
