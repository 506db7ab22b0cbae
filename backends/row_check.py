"""Does a row round as it does inside a call of any other width, on this host?
A bitwise self-check, run once per host, runtime and lowered graph, cached.

Quantized matmul kernels may take a path for some call widths whose reduction
order differs from their main kernel: a one-row path (a GEMV), or a tail that
handles an odd call's last row alone. Then a one-token decode, or the last row
of an odd-width verify, rounds apart from the same row elsewhere, and
speculative output could differ from target-only. Measured: onnxruntime's
MatMulNBits 4-bit blocks of 32 round every row alike on an AVX-512/VNNI host
and one row apart on an AVX2 one; 4-bit blocks of 64 and 128 round an odd
call's last row apart on AVX-512 hosts while every even call agrees. So the
graph runners pad, and how is measured here, not assumed, for the cheapest
padding that is exact, in this order:

  none    every call as it comes;
  single  a one-token call runs as two rows (the token twice, the second discarded);
  pairs   every call of an odd number of rows gets one more (its last row again).

The check, for two context lengths: a prefix of random tokens, then 16 rows
scored in one call (the reference), and again in calls of 1, 2, 3 and 5 rows
padded as the candidate says; every row must equal its reference, bit for bit.
Random tokens make every logit of every layer a witness: a kernel whose
summation order differs for a row shows it in the last bits of almost every
output. pairs is exact wherever single or none is (it only adds even calls), so
it is the padding forced by pad_single_row: 1 (BackendOptions.pad_single_row, a
config's `options.pad_single_row`); 0 forces none, and the names none/single/pairs
force that one (tests and experiments). No exact
padding at all is an error, never a silent fallback; that verdict is cached too
(a later load raises it at once instead of checking for seconds again; the
onnxruntime runner then runs our own matmul). The verdict is cached
(ir.cache) under the host's CPU model and flags (all of them, digested), the
runtime's version and the graph's own cache key, so a new host, a runtime
upgrade or another model checks again.
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

from hetero_sd.backends.options import PADDINGS
from hetero_sd.ir.errors import BackendError

CHECK_VERSION = 2  # bumped when the check itself changes: old verdicts miss
CONTEXTS = (5, 37)  # prefix lengths the rows are scored after
ROWS = 16  # rows scored per context: once in one call (the reference), then in calls of WIDTHS
WIDTHS = (1, 2, 3, 5)
_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile",
          "amx_int8", "amx_bf16", "asimd", "sve", "i8mm")
NO_EXACT = "no padding is exact"
_SAYS = {"none": ("calls unpadded", "a row rounds alike in calls of any width on this host"),
         "single": ("one-token calls padded to two rows", "one row rounds apart on this host"),
         "pairs": ("odd-width calls padded by one row (one-token calls to two)",
                   "an odd call's last row rounds apart on this host"),
         "inexact": (NO_EXACT, "rows round apart under every padding on this host (the runtime's "
                     "kernel is not used for an exact target)")}


def padded(padding: str, rows: int) -> bool:
    """Does a call of `rows` rows get one more under this padding?"""
    return (padding == "single" and rows == 1) or (padding == "pairs" and rows % 2 == 1)


@dataclass(frozen=True)
class Verdict:
    padding: str  # one of PADDINGS (INEXACT only in hetero-sd devices' listing)
    how: str  # "checked" | "cached" | "forced" | "not needed"
    detail: str = ""

    @property
    def pad(self) -> bool:
        return self.padding != "none"

    def describe(self) -> str:
        what, why = _SAYS[self.padding]
        if self.how == "forced":
            return f"{what} ({self.detail})"
        return f"{what}: {why} ({self.how}{': ' + self.detail if self.detail else ''})"


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


def _forced(padding: str | None) -> Verdict | None:
    """The verdict a forced padding (BackendOptions.forced_padding) gives; None: not forced."""
    if padding in PADDINGS:
        return Verdict(padding, "forced", f"pad_single_row: {padding}")
    return None


INEXACT = "inexact"  # the cached verdict where no padding is exact


def cached_verdict(cache_folder: Path | None, forced_padding: str | None = None) -> Verdict | None:
    """The forced padding's verdict, or the one cached in `cache_folder`; None: only a check
    can tell. Raises BackendError where the cached check found no padding exact."""
    forced = _forced(forced_padding)
    if forced is not None:
        return forced
    got = _read(cache_folder)
    if got is None:
        return None
    if got["padding"] == INEXACT:
        raise BackendError(f"{got['detail']} (cached: delete {cache_folder} to check again)")
    return Verdict(got["padding"], "cached", got.get("detail", ""))


def _read(cache_folder: Path | None) -> dict | None:
    path = None if cache_folder is None else cache_folder / "row_check.json"
    if path is None or not path.exists():
        return None
    try:
        got = json.loads(path.read_text())
        if got["padding"] in PADDINGS or (got["padding"] == INEXACT and got["detail"]):
            return got
    except (OSError, ValueError, KeyError):
        pass  # a broken entry: check again
    return None


def _write(cache_folder: Path | None, padding: str, detail: str, label: str) -> None:
    if cache_folder is None:
        return
    path = cache_folder / "row_check.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"padding": padding, "detail": detail, "host": host_signature(), "label": label}))
    os.replace(tmp, path)


def settle(runner, cache_folder: Path | None, label: str = "", forced_padding: str | None = None) -> Verdict:
    """The verdict for `runner` (a graph runner whose calls are unpadded while this
    runs), from `forced_padding`, the cache, or a check now: the cheapest exact padding.
    `label` names the model and placement in the cache entry (hetero-sd devices lists
    them). Raises BackendError where no padding makes the rows round alike."""
    known = cached_verdict(cache_folder, forced_padding)
    if known is not None:
        return known
    t0 = time.perf_counter()
    found = []
    for padding in PADDINGS:
        exact, detail = check(runner, padding)
        found.append(f"{padding}: {detail}")
        if exact:
            break
    else:
        why = (f"{label or 'this graph'}: rows round apart between call widths under every padding "
               f"({'; '.join(found)}), so speculative output could differ from target-only; "
               "use precision fp32 or another backend on this host")
        _write(cache_folder, INEXACT, why, label)
        raise BackendError(why)
    detail = f"{detail}; {time.perf_counter() - t0:.1f} s"
    _write(cache_folder, padding, detail, label)
    return Verdict(padding, "checked", detail)


def cached_verdicts(root: Path) -> list[tuple[str, Verdict]]:
    """(label, verdict) of every check cached under `root` for this host, sorted."""
    host, out = host_signature(), []
    for path in sorted(root.glob("*/row_check.json")):
        got = _read(path.parent)
        if got is not None and got.get("host") == host:
            detail = "" if got["padding"] == INEXACT else got.get("detail", "")
            out.append((got.get("label") or path.parent.name, Verdict(got["padding"], "cached", detail)))
    return sorted(out, key=lambda item: item[0])


def check(runner, padding: str = "none") -> tuple[bool, str]:
    """(every row of calls of WIDTHS, padded as `padding` says, equals its row in one
    16-row call, what was compared or where it failed). The runner must run its calls
    unpadded while this runs (the padding is applied here); its pool gets one sequence
    at a time, released."""
    rng = np.random.default_rng(20261201)
    compared = 0
    for ctx in CONTEXTS:
        seq = runner.allocate(ctx + ROWS + 2)
        try:
            prefix = rng.integers(0, runner.vocab_size, ctx).tolist()
            rows = rng.integers(0, runner.vocab_size, ROWS).tolist()
            runner.forward(seq, prefix, 0, 1)
            reference = runner.forward(seq, rows, ctx, ROWS)
            for width in WIDTHS:
                for lo in range(0, ROWS, width):
                    chunk = rows[lo:lo + width]
                    ids = chunk + chunk[-1:] if padded(padding, len(chunk)) else chunk
                    runner.truncate(seq, ctx + lo)
                    got = runner.forward(seq, ids, ctx + lo, len(ids))[:len(chunk)]
                    for j, row in enumerate(got):
                        compared += 1
                        if not np.array_equal(row, reference[lo + j]):
                            return False, (f"row {lo + j} after {ctx} tokens differs in a {len(chunk)}-row "
                                           f"call{' (padded)' if len(ids) > len(chunk) else ''} and a {ROWS}-row one")
        finally:
            runner.release(seq)
    return True, (f"{compared} rows bitwise equal in one {ROWS}-row call and in calls of "
                  f"{', '.join(map(str, WIDTHS))}")
