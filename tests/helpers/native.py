"""Which hosts can build our own kernels (backends/native): an x86-64 CPU with AVX2.
Elsewhere the graphs keep onnxruntime's own ops (options native: off runs them here too),
on every host; a build failure on such a CPU fails the tests that need it."""
from __future__ import annotations

import platform

import pytest

from hetero_sd.backends.row_check import host_signature


def x86_avx2() -> bool:
    return platform.machine() in ("x86_64", "AMD64") and "avx2" in host_signature()["flags"]


needs_avx2 = pytest.mark.skipif(not x86_avx2(), reason="our kernels need an x86-64 CPU with AVX2")


def x86_avx512() -> bool:
    """Whether the host runs BlockMatMul's AVX-512 VNNI code (its AVX2 code runs there too)."""
    flags = host_signature()["flags"]
    return x86_avx2() and all(f in flags for f in ("avx512f", "avx512bw", "avx512_vnni"))


# the AVX2 code is built on an AVX-512 host too, by turning AVX-512 off
ISAS = [pytest.param("", id="native"),
        pytest.param("-mno-avx512f", id="avx2", marks=pytest.mark.skipif(not x86_avx512(), reason="the host's own "
                                                                         "build is the AVX2 one (case 'native')"))]


@pytest.fixture(params=ISAS, name="library")
def matmul_library(request):
    """Our kernels' library, built for the host and (on an AVX-512 host) for AVX2 alone;
    on an AVX2 CPU a build failure fails the test."""
    from hetero_sd.backends import native
    from hetero_sd.backends.options import BackendOptions

    return native.library("matmul", BackendOptions(native=("matmul",), native_cflags=request.param))


def assert_rows_alike(run, a):
    """Bitwise: the rows of one call of all of `a` (70 rows: a prefill, two row tasks)
    against the same rows in calls of 1..16 rows at several offsets, and each row alone.
    `run(x)` is one call of the op; returns that whole call's output."""
    import numpy as np

    whole = run(a)
    for m in range(1, 17):
        for i in range(0, 17 - m, 5):
            assert np.array_equal(run(a[i:i + m]), whole[i:i + m]), (m, i)
    assert np.array_equal(np.concatenate([run(a[i:i + 1]) for i in range(len(a))]), whole)
    return whole


def load_pool_graph(backend, model, device: str, precision: str, budget: int):
    """onnxruntime's graph that gathers attention from the pool (onnx_batch.py): what a
    host runs where SlabAttention cannot be built or does not cover the model, loaded
    here by turning our attention off for the load."""
    from hetero_sd.backends.options import BackendOptions

    runner = backend.load(model, device, precision, budget, options=BackendOptions(native=("matmul",)))
    assert runner.kernel_choice.startswith("attention gathered from the pool"), runner.kernel_choice
    return runner
