"""The native kernels' build (backends/native) under a compiler that hangs: past its timeout the
compiler is killed and the build fails as any failed build does (NativeUnavailable), so
`kernel_available` says why and the graphs keep onnxruntime's own ops, instead of the model's
load hanging. The compiler is $CC (as `_compiler` reads it), here a shell script that sleeps."""
from __future__ import annotations

import platform
import stat
import time
from pathlib import Path

import pytest

from hetero_sd.backends import native
from hetero_sd.backends.options import BackendOptions


def _fake_cc(folder: Path, version: str, build: str) -> Path:
    """A compiler: `--version` runs the shell line `version`, anything else `build`."""
    path = folder / "slow-cc"
    path.write_text(f'#!/bin/sh\nif [ "$1" = --version ]; then {version}; else {build}; fi\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """No cached library and no remembered build; a host the kernels are built for, whatever this one is."""
    monkeypatch.setenv("HETERO_SD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(native, "host_signature", lambda: {"flags": {"avx2"}, "isa": "test"})
    monkeypatch.setattr(native, "VERSION_TIMEOUT_S", 1.0)
    monkeypatch.setattr(native, "COMPILE_TIMEOUT_S", 1.0)
    native._build.cache_clear()
    yield
    native._build.cache_clear()


@pytest.mark.skipif(platform.system() == "Windows", reason="the fake compiler is a shell script")
@pytest.mark.parametrize("hangs", ["--version", "build"])
def test_a_hung_compiler_times_out_and_the_kernels_are_off(fresh_build, monkeypatch, tmp_path, hangs):
    cc = _fake_cc(tmp_path, "sleep 30" if hangs == "--version" else "echo 'slow-cc 1.0'",
                  "sleep 30" if hangs == "build" else "exit 1")
    monkeypatch.setenv("CC", str(cc))
    what = "--version" if hangs == "--version" else "building the native kernels"
    t0 = time.monotonic()
    with pytest.raises(native.NativeUnavailable, match=f"C compiler {cc} timed out after 1 s \\({what}\\)"):
        native.library("matmul", BackendOptions(native=("matmul",)))
    assert time.monotonic() - t0 < 10  # the sleeping child was killed, not waited for
    native._build.cache_clear()
    ok, why = native.kernel_available("matmul", BackendOptions(native=("matmul",)))
    assert not ok and f"{cc} timed out after 1 s" in why
    assert not list((tmp_path / "cache").rglob("*.so"))  # nothing half built left in the cache
