"""Which hosts can build our own kernels (backends/native): an x86-64 CPU with AVX2.
Elsewhere the graphs keep GroupQueryAttention, which test_graph_backends.py covers
on every host; a build failure on such a CPU fails the tests that need it."""
from __future__ import annotations

import platform

import pytest

from hetero_sd.backends.row_check import host_signature


def x86_avx2() -> bool:
    return platform.machine() in ("x86_64", "AMD64") and "avx2" in host_signature()["flags"]


needs_avx2 = pytest.mark.skipif(not x86_avx2(), reason="SlabAttention needs an x86-64 CPU with AVX2")
