"""Backend options: the switches a run gives its backends, as one typed record.

    BackendOptions()                                      today's defaults
    BackendOptions(native=("matmul",), native_matmul="always", pad_single_row="pairs")

A config's `options:` section becomes one (hetero_sd/options.py), carried by every
ModelSpec to the Loader, which hands it to `Backend.load(..., options=...)` (and a
registry's backends at construction: `registry.discover(options)`), so two engines
in one process may differ and a worker process gets its spec's own. Nothing under
backends/ reads the environment for them.

- native: our compiled kernels the CPU's graph may use (backends/native): any of
  KERNELS; () uses onnxruntime's own ops alone.
- native_matmul: "auto" (ours where timed the faster exact path on this host,
  kernel_timing.py) or "always" (ours without timing).
- native_cflags: extra C compiler flags for the kernels' build ("-mno-avx512f" builds
  the AVX2 code on an AVX-512 host); part of the library's cache key.
- pad_single_row: "auto" (the row check decides, row_check.py) or a forced padding,
  one of row_check.PADDINGS; part of the kernel choice's cache key.
- plugins: backends not installed as packages, "name=module:Class" (registry.py).
- fake: the fake backend's settings (hetero_sd/testing/fake_backend.py): JSON, or the
  path of a YAML/JSON file; "" declares no device.
"""
from __future__ import annotations

from dataclasses import dataclass

KERNELS = ("matmul", "attention")  # our kernels (backends/native)
MATMUL_POLICIES = ("auto", "always")
PADDINGS = ("none", "single", "pairs")  # row_check.PADDINGS, cheapest first
PAD_CHOICES = ("auto", *PADDINGS)


@dataclass(frozen=True)
class BackendOptions:
    native: tuple[str, ...] = KERNELS
    native_matmul: str = "auto"
    native_cflags: str = ""
    pad_single_row: str = "auto"
    plugins: tuple[str, ...] = ()
    fake: str = ""

    def __post_init__(self):
        unknown = [k for k in self.native if k not in KERNELS]
        if unknown:
            raise ValueError(f"native: unknown kernel {unknown[0]!r}; one or more of {', '.join(KERNELS)}")
        if self.native_matmul not in MATMUL_POLICIES:
            raise ValueError(f"native_matmul: {self.native_matmul!r} is not one of {', '.join(MATMUL_POLICIES)}")
        if self.pad_single_row not in PAD_CHOICES:
            raise ValueError(f"pad_single_row: {self.pad_single_row!r} is not one of {', '.join(PAD_CHOICES)}")

    @property
    def forced_padding(self) -> str | None:
        """The padding pad_single_row forces, or None where the row check decides."""
        return None if self.pad_single_row == "auto" else self.pad_single_row


DEFAULT = BackendOptions()


def parse_native(value) -> tuple[str, ...]:
    """The kernels a `native:` value names: auto / on / all / true / 1 (both), off / none /
    false / 0 / "" (none), a kernel, a comma-separated list or a list of kernels."""
    if isinstance(value, bool):
        return KERNELS if value else ()
    if isinstance(value, (list, tuple)):
        named = tuple(str(k).strip().lower() for k in value)
    else:
        text = str(value).strip().lower()
        if text in ("auto", "on", "all", "1", "true"):
            return KERNELS
        if text in ("off", "none", "0", "", "false"):
            return ()
        named = tuple(k.strip() for k in text.split(","))
    unknown = [k for k in named if k not in KERNELS]
    if unknown:
        raise ValueError(f"unknown kernel {unknown[0]!r}; one or more of {', '.join(KERNELS)}, "
                         "or auto / on (all), off (none)")
    return named


def parse_padding(value) -> str:
    """A pad_single_row value: auto, none, single, pairs (1 is pairs, 0 none: the old switch)."""
    text = str(value).strip().lower()
    text = {"1": "pairs", "0": "none", "true": "pairs", "false": "none", "": "auto"}.get(text, text)
    if text not in PAD_CHOICES:
        raise ValueError(f"{value!r} is not one of {', '.join(PAD_CHOICES)} (or 1 = pairs, 0 = none)")
    return text
