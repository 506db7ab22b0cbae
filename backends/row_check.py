"""Does one row round as it does inside a multi-row call, on this host? A
bitwise self-check, run once per host, runtime and lowered graph, cached.

Quantized matmul kernels may take a one-row path (a GEMV) whose reduction
order differs from their multi-row kernel: then a one-token decode rounds
apart from the same row inside a verify, and speculative output could differ
from target-only. Where that happens the graph runners run one-token calls as
two rows (the token twice, the second discarded), which costs up to 40% of a
step at 1.5B shapes. Whether it happens depends on the kernel the runtime
picks for the host's instruction set (measured: onnxruntime's MatMulNBits
rows are bitwise equal for M = 1..9 on an AVX-512/VNNI host and differ on an
AVX2 one), so it is measured here, not assumed:

  for two context lengths, a prefix of random tokens, then 16 rows scored in
  calls of 16, 5 and 2 rows, and each of the 16 again alone (unpadded);
  every one-row result must equal its row in every multi-row call, bit for bit.

Random tokens make every logit of every layer a witness: a kernel whose
summation order differs for one row shows it in the last bits of almost every
output. The verdict is cached (ir.cache) under the host's CPU model and flags (all
of them, digested),
the runtime's version and the graph's own cache key, so a new host, a runtime
upgrade or another model checks again. HETERO_SD_PAD_SINGLE_ROW=1 (or 0)
overrides the verdict (1 pads, 0 does not), for tests and experiments.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ENV = "HETERO_SD_PAD_SINGLE_ROW"
CHECK_VERSION = 1  # bumped when the check itself changes: old verdicts miss
CONTEXTS = (5, 37)  # prefix lengths the rows are scored after
ROWS = 16  # rows scored per context, in calls of each width below
WIDTHS = (16, 5, 2)
_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile",
          "amx_int8", "amx_bf16", "asimd", "sve", "i8mm")


@dataclass(frozen=True)
class Verdict:
    one_row_exact: bool  # one row rounds as inside a multi-row call: no padding needed
    how: str  # "checked" | "cached" | "forced" | "not needed"
    detail: str = ""

    @property
    def pad(self) -> bool:
        return not self.one_row_exact

    def describe(self) -> str:
        if self.how == "forced":
            return f"one-token calls {'unpadded' if self.one_row_exact else 'padded to two rows'} ({self.detail})"
        if self.one_row_exact:
            what = "one-token calls unpadded: one row rounds as in a multi-row call on this host"
        else:
            what = "one-token calls padded to two rows: one row rounds apart on this host"
        return f"{what} ({self.how}{': ' + self.detail if self.detail else ''})"


def host_signature() -> dict:
    """What the kernels a runtime picks depend on: the CPU and its instruction sets."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name":
                name = value.strip()
            elif key in ("flags", "Features"):
                flags = set(value.split())
                break
    except OSError:
        pass
    # "isa": every flag the kernel reports, digested: a runtime may dispatch on one _FLAGS
    # does not name (avx512_fp16, say), and two hosts sharing a model name and those flags
    # must not share a verdict; "flags" stays the readable part (hetero-sd devices).
    isa = hashlib.sha1(" ".join(sorted(flags)).encode()).hexdigest()[:12]
    return {"cpu": name, "flags": sorted(f for f in _FLAGS if f in flags), "isa": isa,
            "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()}


def _forced() -> Verdict | None:
    value = os.environ.get(ENV, "").strip()
    if value in ("1", "0"):
        return Verdict(value == "0", "forced", f"{ENV}={value}")
    return None


def settle(runner, cache_folder: Path | None, label: str = "") -> Verdict:
    """The verdict for `runner` (a graph runner whose one-token calls are unpadded
    while this runs), from the override, the cache, or a check now. `label` names
    the model and placement in the cache entry (hetero-sd devices lists them)."""
    forced = _forced()
    if forced is not None:
        return forced
    path = None if cache_folder is None else cache_folder / "row_check.json"
    if path is not None and path.exists():
        try:
            got = json.loads(path.read_text())
            return Verdict(bool(got["one_row_exact"]), "cached", got.get("detail", ""))
        except (OSError, ValueError, KeyError):
            pass  # a broken entry: check again
    t0 = time.perf_counter()
    exact, detail = check(runner)
    detail = f"{detail}; {time.perf_counter() - t0:.1f} s"
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"one_row_exact": exact, "detail": detail, "host": host_signature(),
                                   "label": label}))
        os.replace(tmp, path)
    return Verdict(exact, "checked", detail)


def cached_verdicts(root: Path) -> list[tuple[str, Verdict]]:
    """(label, verdict) of every check cached under `root` for this host, sorted."""
    host, out = host_signature(), []
    for path in sorted(root.glob("*/row_check.json")):
        try:
            got = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if got.get("host") == host:
            out.append((got.get("label") or path.parent.name, Verdict(bool(got["one_row_exact"]), "cached",
                                                                     got.get("detail", ""))))
    return sorted(out, key=lambda item: item[0])


def check(runner) -> tuple[bool, str]:
    """(one row rounds as in multi-row calls, what was compared). The runner must run
    one-token calls unpadded while this runs; its pool gets one sequence, released."""
    rng = np.random.default_rng(20261201)
    compared = 0
    for ctx in CONTEXTS:
        seq = runner.allocate(ctx + ROWS + 1)
        try:
            prefix = rng.integers(0, runner.vocab_size, ctx).tolist()
            rows = rng.integers(0, runner.vocab_size, ROWS).tolist()
            runner.forward(seq, prefix, 0, 1)
            alone = []
            for i, token in enumerate(rows):
                alone.append(runner.forward(seq, [token], ctx + i, 1)[0])
            for width in WIDTHS:
                for lo in range(0, ROWS, width):
                    chunk = rows[lo:lo + width]
                    if len(chunk) < 2:
                        continue
                    runner.truncate(seq, ctx + lo)
                    got = runner.forward(seq, chunk, ctx + lo, len(chunk))
                    for j, row in enumerate(got):
                        compared += 1
                        if not np.array_equal(row, alone[lo + j]):
                            return False, (f"row {lo + j} after {ctx} tokens differs alone and in a "
                                           f"{len(chunk)}-row call")
        finally:
            runner.release(seq)
    return True, f"{compared} rows bitwise equal alone and in calls of {', '.join(map(str, WIDTHS))}"
