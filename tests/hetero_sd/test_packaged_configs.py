"""Every YAML in configs/ loads; those that can run on this host run losslessly."""
from pathlib import Path

import pytest

from hetero_sd.engine import build_engine
from hetero_sd.config import PACKAGED, load_config

ALL = sorted(p.name for p in PACKAGED.glob("*.yaml"))
ACCELERATOR_ONLY = {"cuda-cpu.yaml", "ascend-cpu.yaml"}  # documented; need hardware and model paths
# auto.yaml profiles every backend on its first run; the test narrows it to torch, quick.
OVERRIDES = {"auto.yaml": {"auto.backends": ["torch"], "auto.quick": True}}


def test_expected_examples_exist():
    assert {"cpu.yaml", "cpu-draft-model.yaml", "onnxruntime.yaml", "openvino.yaml", "mixed-cpu.yaml",
            "cuda-cpu.yaml", "ascend-cpu.yaml", "auto.yaml", "shm-async.yaml", "cascade.yaml"} <= set(ALL)


@pytest.mark.parametrize("name", ALL)
def test_loads(name):
    cfg = load_config(PACKAGED / name)
    assert cfg.target.backend in ("torch", "onnxruntime", "openvino")


@pytest.mark.parametrize("name", [n for n in ALL if n not in ACCELERATOR_ONLY])
def test_runs_losslessly_here(name):
    engine = build_engine(load_config(PACKAGED / name, OVERRIDES.get(name)))
    assert (engine.plan is not None) == (name == "auto.yaml")
    prompt = "Repeat exactly: red green blue, red green blue, red green blue."
    spec = engine.generate(prompt, max_new_tokens=12)
    base = engine.generate(prompt, max_new_tokens=12, target_only=True)
    assert spec.token_ids == base.token_ids and spec.stats.lossless == "exact"
