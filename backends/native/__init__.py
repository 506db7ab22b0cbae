"""Kernels of our own, compiled on the host that runs them: onnxruntime custom ops
(domain "hetero_sd.native") in one library.

- `block_matmul.c` (BlockMatMul): the linear layers' block-quantized matmul, on
  MatMulNBits' own weights, with every row computed alike whatever the call's
  width. MatMulNBits' one-row kernel rounds apart on most hosts, so an exact
  one-token step was padded to two rows; with this op it runs as one.
- `gguf_matmul.c` (GGUFMatMul): precision gguf's K-quant layers (Q4_K, Q6_K) on the
  file's own super-blocks, 8 columns interleaved (backends/gguf_pack.py), the
  sub-block scales and minimums applied in integers as llama.cpp's vec_dot does;
  every row computed alike whatever the call's width.
- `slab_attention.c` (SlabAttention): attention over the KV pool one query row at a
  time, for every sequence of a call (varlen), so a row rounds alike alone, inside
  any verify and inside any batch of sequences by construction: one graph serves
  the command line and the server alike (onnx_native.py).

They are compiled at first use with the machine's C compiler for the host's own
instruction set (-march=native: AVX2, AVX-512 with VNNI, whatever the CPU has),
then cached under the sources' hash, the compiler's version and the CPU's flags,
so a new host or a new source compiles again (a few seconds).

BackendOptions.native (backends/options.py; a config's `options.native`) picks which
the CPU's graph uses (KERNELS): by default both. Measured side by side on a 2-core AMD EPYC (AVX-512), a one-token
step with SlabAttention took 0.68-0.97x the time with GroupQueryAttention in all
but one of nine cells (the most at long contexts) and verifies of 2-9 rows about
as long (0.9-1.1x), so it runs wherever it covers the model (docs/backends.md). Where a kernel is off, or no compiler is
found, the graphs use onnxruntime's own op, and `kernel_available()` says why.
"""
from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import signal
import subprocess
from functools import lru_cache
from pathlib import Path

from hetero_sd.backends.options import DEFAULT as DEFAULT_OPTIONS, KERNELS, BackendOptions
from hetero_sd.backends.row_check import host_signature
from hetero_sd.ir.cache import cache_root, cached

DOMAIN = "hetero_sd.native"  # the custom ops' domain (register.c)
DEFAULT = DEFAULT_OPTIONS.native  # the kernels on by default: all of KERNELS
HERE = Path(__file__).parent
SOURCES = ("ort_api.h", "block_simd.h", "vec_math.h", "gguf_blocks.h", "block_matmul.c", "gguf_matmul.c", "slab_attention.c", "register.c")
# -ffp-contract=off: a multiply and an add stay two roundings wherever the compiler
# inlines them, so every copy of a loop rounds alike (the ops' row invariance)
FLAGS = ("-O2", "-march=native", "-ffp-contract=off", "-shared", "-fPIC", "-fvisibility=hidden")
# How long the compiler may run (seconds): a hung one makes the build fail (NativeUnavailable,
# so the graphs use onnxruntime's own ops) instead of hanging the model's load
VERSION_TIMEOUT_S = 30.0  # `cc --version`
COMPILE_TIMEOUT_S = 300.0  # the kernels' build: a few seconds on an idle host


class NativeUnavailable(RuntimeError):
    """Why the compiled kernels cannot be used here (the message says)."""


def _compiler() -> list[str]:
    """The C compiler's command line ($CC may carry arguments: "ccache gcc")."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise NativeUnavailable("no C compiler (cc, gcc or clang) on PATH")
    return shlex.split(cc)


def _run(cc: list[str], args: list[str], timeout: float, what: str) -> subprocess.CompletedProcess:
    """Run the compiler `cc` on `args`, its output captured. Past `timeout` seconds it is killed with
    every process it started (its own session: a driver's cc1 and as too) and NativeUnavailable says so."""
    with subprocess.Popen([*cc, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException as exc:  # the timeout, or Ctrl-C while it ran: nothing of it outlives the call
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (AttributeError, OSError):  # no process groups (Windows), or already gone
                proc.kill()
            proc.wait()
            if isinstance(exc, subprocess.TimeoutExpired):
                raise NativeUnavailable(f"the C compiler {' '.join(cc)} timed out after {timeout:g} s "
                                        f"({what})") from None
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@lru_cache(maxsize=None)
def _build(extra_flags: str) -> Path:
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        raise NativeUnavailable(f"the kernels are written for x86-64 (AVX2 at least), not {platform.machine()}")
    host = host_signature()
    if "avx2" not in host["flags"]:
        raise NativeUnavailable("this CPU has no AVX2")
    cc = _compiler()
    try:
        version = _run(cc, ["--version"], VERSION_TIMEOUT_S, "--version").stdout.splitlines()[:1]
    except OSError as e:
        raise NativeUnavailable(f"cannot run {' '.join(cc)}: {e}") from e
    flags = (*FLAGS, *shlex.split(extra_flags))
    # -march=native: the library is this CPU's (host["isa"] digests all its flags)
    texts = [(HERE / name).read_text() for name in SOURCES]
    key = hashlib.sha256("\0".join([*texts, *version, " ".join(flags), host["isa"]]).encode())
    sources = [str(HERE / name) for name in SOURCES if name.endswith(".c")]

    def compile_to(target: Path) -> None:
        run = _run(cc, [*flags, *sources, "-lm", "-o", str(target)], COMPILE_TIMEOUT_S,
                   "building the native kernels")
        if run.returncode != 0:
            raise NativeUnavailable(f"{' '.join(cc)} failed on the native kernels: {run.stderr.strip()[-400:]}")

    return cached(cache_root() / "native" / f"kernels-{key.hexdigest()[:20]}", "hetero_sd_native.so", compile_to)


def native_fits(cfg) -> tuple[bool, str]:
    """(whether SlabAttention computes this model's attention, why not). Per-head q/k
    norms run in the graph before it; windows and score soft-caps inside it."""
    if cfg.head_dim % 16 or cfg.head_dim > 512:
        return False, f"head dimension {cfg.head_dim} (needs a multiple of 16, at most 512)"
    if cfg.num_heads % cfg.num_kv_heads or cfg.num_heads // cfg.num_kv_heads > 64:
        return False, f"{cfg.num_heads} heads over {cfg.num_kv_heads} KV heads"
    return True, ""


def matmul_fits(k: int, bits: int, block: int) -> bool:
    """Whether BlockMatMul computes a MatMulNBits of this shape (block_matmul.c)."""
    return bits in (4, 8) and block in (32, 64, 128, 256) and k % 64 == 0 and k % block == 0


# GGUF block types GGUFMatMul reads as the file stores them (gguf_matmul.c), by ggml's numbering
GGUF_TYPES = {"Q4_K": 12, "Q6_K": 14, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8}


def gguf_fits(kind: str | None, k: int) -> bool:
    """Whether GGUFMatMul computes a weight of this GGUF type and row length (K-quants'
    super-blocks of 256; the 32-value types in pairs of blocks, 64 values)."""
    return kind in GGUF_TYPES and k % (256 if kind.endswith("_K") else 64) == 0


def how_to_turn_on(kernel: str, options: BackendOptions) -> str:
    others = [k for k in options.native if k != kernel]
    return f"off (native: {','.join([*others, kernel])} turns it on)"


def library(kernel: str, options: BackendOptions = DEFAULT_OPTIONS) -> Path:
    """The compiled library, for `kernel` (one of KERNELS) as `options` build it;
    NativeUnavailable says why not."""
    if kernel not in options.native:
        raise NativeUnavailable(how_to_turn_on(kernel, options))
    return _build(options.native_cflags)


def gguf_pairs(options: BackendOptions = DEFAULT_OPTIONS) -> bool:
    """Whether the library built here reads step pairs as AVX-512's (a column's
    two steps together) rather than AVX2's (gguf_blocks.h PAIRS): the lowering packs
    the weights so (gguf_pack.py) and says it in GGUFMatMul's `pairs` attribute."""
    return pairs_of(library("matmul", options))


@lru_cache(maxsize=None)
def pairs_of(path: Path) -> bool:
    """The step-pair layout a built library reads (its hetero_sd_gguf_pairs)."""
    import ctypes

    return bool(ctypes.CDLL(str(path)).hetero_sd_gguf_pairs())


def kernel_available(kernel: str, options: BackendOptions = DEFAULT_OPTIONS) -> tuple[bool, str]:
    """(usable, why not) without raising."""
    try:
        library(kernel, options)
        return True, ""
    except NativeUnavailable as e:
        return False, str(e)
