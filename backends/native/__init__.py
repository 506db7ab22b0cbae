"""Kernels of our own, compiled on the host that runs them.

`slab_attention.c` is an onnxruntime custom op (SlabAttention): attention over a
sequence's KV slab one query row at a time, so a row rounds alike alone or inside
any verify by construction, and a one-token call needs no second attention row
(onnx_gqa.py explains why GroupQueryAttention does). It is compiled at first use
with the machine's C compiler for the host's own instruction set (-march=native:
AVX2, AVX-512, whatever the CPU has), then cached under the source's hash, the
compiler's version and the CPU's flags, so a new host or a new source compiles
again (about a second).

Off unless HETERO_SD_NATIVE=1: measured side by side on a 2-core AMD EPYC
(AVX-512), it makes a one-token step 9-19% faster on SmolLM2 (more at long
contexts: 1.7x at 2,000 cached tokens) but a verify of 5-9 rows and a prefill
slower than GroupQueryAttention's GEMMs (docs/backends.md), and speculative
decoding lives on verifies. Where it is off, or no compiler is found, the
graphs use GroupQueryAttention; `attention_library()` says why.
"""
from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path

from hetero_sd.backends.row_check import host_signature
from hetero_sd.ir.cache import cache_root, cached

ENV = "HETERO_SD_NATIVE"  # 1: use the compiled kernels where they cover the model
SOURCE = Path(__file__).with_name("slab_attention.c")
FLAGS = ("-O2", "-march=native", "-shared", "-fPIC", "-fvisibility=hidden")


class NativeUnavailable(RuntimeError):
    """Why the compiled kernels cannot be used here (the message says)."""


def _compiler() -> list[str]:
    """The C compiler's command line ($CC may carry arguments: "ccache gcc")."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise NativeUnavailable("no C compiler (cc, gcc or clang) on PATH")
    return shlex.split(cc)


@lru_cache(maxsize=None)
def _build() -> Path:
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        raise NativeUnavailable(f"the kernels are written for x86-64 (AVX2 at least), not {platform.machine()}")
    host = host_signature()
    if "avx2" not in host["flags"]:
        raise NativeUnavailable("this CPU has no AVX2")
    cc = _compiler()
    try:
        version = subprocess.run([*cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    except OSError as e:
        raise NativeUnavailable(f"cannot run {' '.join(cc)}: {e}") from e
    # -march=native: the library is this CPU's (host["isa"] digests all its flags)
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *version, " ".join(FLAGS), host["isa"]]).encode())

    def compile_to(target: Path) -> None:
        run = subprocess.run([*cc, *FLAGS, str(SOURCE), "-o", str(target)], capture_output=True, text=True)
        if run.returncode != 0:
            raise NativeUnavailable(f"{' '.join(cc)} failed on {SOURCE.name}: {run.stderr.strip()[-400:]}")

    return cached(cache_root() / "native" / f"slab_attention-{key.hexdigest()[:20]}", "slab_attention.so",
                  compile_to)


def native_fits(cfg) -> tuple[bool, str]:
    """(whether SlabAttention computes this model's attention, why not)."""
    if cfg.qk_norm:
        return False, "per-head q/k norms"
    if any(w is not None for w in cfg.windows):
        return False, "sliding-window layers"
    if cfg.attn_softcap is not None:
        return False, "attention soft-capping"
    if cfg.head_dim % 16 or cfg.head_dim > 512:
        return False, f"head dimension {cfg.head_dim} (needs a multiple of 16, at most 512)"
    if cfg.num_heads % cfg.num_kv_heads or cfg.num_heads // cfg.num_kv_heads > 64:
        return False, f"{cfg.num_heads} heads over {cfg.num_kv_heads} KV heads"
    return True, ""


def attention_library() -> Path:
    """The compiled SlabAttention library for this host; NativeUnavailable says why not."""
    if os.environ.get(ENV, "0") != "1":
        raise NativeUnavailable(f"off ({ENV}=1 turns it on)")
    return _build()


def attention_available() -> tuple[bool, str]:
    """(usable, why not) without raising."""
    try:
        attention_library()
        return True, ""
    except NativeUnavailable as e:
        return False, str(e)
