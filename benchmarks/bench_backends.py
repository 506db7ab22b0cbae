"""Target-only greedy decoding on each of our backends and precisions, against
OpenVINO GenAI on the same GGUF: a thin wrapper over `hetero-sd bench`.

    python benchmarks/bench_backends.py [--backends torch-fp32,ort-fp32,...] [--max-new-tokens 64]
                                        [any hetero-sd bench option]

Writes one target-only YAML per backend/precision (drafter: none) and runs the
bench with them and the GenAI peer (its defaults and its exact hints, prefix
caching off, fresh pipeline per run, our token ids). The first backend is the
baseline every ratio is taken against. Backends or precisions this host lacks
are left out with a note. Not a test: speed is measured, never asserted.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from hetero_sd.bench.__main__ import main

# key -> (backend, device, precision)
BACKENDS = {
    "torch-fp32": ("torch", "cpu", "fp32"),
    "ort-fp32": ("onnxruntime", "cpu", "fp32"),
    "ort-int8": ("onnxruntime", "cpu", "int8"),
    "ort-int4": ("onnxruntime", "cpu", "int4"),
    "ov-fp32": ("openvino", "CPU", "fp32"),
    "ov-bf16": ("openvino", "CPU", "bf16"),
    "ov-int8": ("openvino", "CPU", "int8"),
    "ov-int4": ("openvino", "CPU", "int4"),
}


def available(keys: list[str]) -> list[str]:
    """The keys whose backend, device and precision this host has (probes only)."""
    from hetero_sd.drafting.specs import ModelSpec
    from hetero_sd.errors import HeteroSDError
    from hetero_sd.loading import Loader

    load, keep = Loader(), []
    for key in keys:
        backend, device, precision = BACKENDS[key]
        try:
            load.check(ModelSpec("", backend, device, precision, role=key))
            keep.append(key)
        except HeteroSDError as exc:
            print(f"left out {key}: {exc}", file=sys.stderr)
    return keep


def run(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], add_help=False)
    ap.add_argument("--backends", default=",".join(BACKENDS), help=f"comma list of {', '.join(BACKENDS)}")
    own, rest = ap.parse_known_args(argv)
    keys = [k.strip() for k in own.backends.split(",") if k.strip()]
    unknown = [k for k in keys if k not in BACKENDS]
    if unknown:
        ap.error(f"unknown backend key(s) {unknown}; choose from {', '.join(BACKENDS)}")
    keys = available(keys)
    if not keys:
        print("no requested backend is available here", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="bench-backends-") as tmp:
        configs = []
        for key in keys:
            backend, device, precision = BACKENDS[key]
            path = Path(tmp) / f"{key}.yaml"
            path.write_text(f"target: {{model: default, backend: {backend}, device: {device}, "
                            f"precision: {precision}}}\ndrafter: {{kind: none}}\n")
            configs += ["--config", str(path)]
        return main(["--peers", "genai", "--max-new-tokens", "64", "--out", "bench-results/backends",
                     *configs, *rest])


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
