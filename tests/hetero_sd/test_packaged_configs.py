"""Every YAML in configs/ loads; those that can run on this host run losslessly."""
from pathlib import Path

import pytest

from hetero_sd.engine import Engine
from hetero_sd.config import PACKAGED, load_config

ALL = sorted(p.name for p in PACKAGED.glob("*.yaml"))
ACCELERATOR_ONLY = {"cuda-cpu.yaml", "ascend-cpu.yaml"}  # documented; need hardware and model paths
# auto.yaml profiles every backend on its first run; the test narrows it to torch, quick.
OVERRIDES = {"auto.yaml": {"auto.backends": ["torch"], "auto.quick": True}}


def test_expected_examples_exist():
    assert {"cpu.yaml", "cpu-draft-model.yaml", "onnxruntime.yaml", "openvino.yaml", "mixed-cpu.yaml",
            "cuda-cpu.yaml", "ascend-cpu.yaml", "auto.yaml", "shm-async.yaml", "cascade.yaml",
            "qwen-coder.yaml", "qwen-coder-hybrid.yaml", "qwen-coder-ngram.yaml", "qwen-coder-mixed.yaml", "qwen-coder-worker.yaml", "json.yaml",
            "qwen-coder-smol.yaml", "qwen-coder-draft.yaml", "llama-smol.yaml"} <= set(ALL)


@pytest.mark.parametrize("name", ALL)
def test_loads(name):
    cfg = load_config(PACKAGED / name)
    assert cfg.target.backend in ("torch", "onnxruntime", "openvino", "cuda")


def test_cuda_config_runs_on_the_interpreter(tiny_model_dir):
    """configs/cuda-cpu.yaml as shipped but its models and sizes: the cuda target on the
    Triton interpreter's cpu device (TRITON_INTERPRET=1, tests/conftest.py), the CPU draft."""
    overrides = {"target.model": str(tiny_model_dir("llama")), "target.device": "cpu",
                 "drafter.model": str(tiny_model_dir("llama", seed=1)), "memory.kv_budget": "4MiB"}
    engine = Engine.from_config(load_config(PACKAGED / "cuda-cpu.yaml", overrides))
    try:
        prompt = "Repeat exactly: red green blue, red green blue."
        spec = engine.generate(prompt, max_new_tokens=6)
        base = engine.generate(prompt, max_new_tokens=6, target_only=True)
        assert spec.token_ids == base.token_ids and spec.stats.lossless == "exact"
    finally:
        engine.close()


@pytest.fixture(scope="module")
def foreign_draft(tmp_path_factory):
    """A tiny draft of another tokenizer (for configs whose draft is another family's):
    its HF folder and its GGUF of every 32-value block type (for a gguf draft)."""
    from helpers.gguf_convert import make_gguf
    from helpers.tiny_models import make_hf_model

    root = tmp_path_factory.mktemp("foreign")
    hf = make_hf_model(root / "draft", "llama", seed=1, vocab_size=320)
    return {"hf": hf, "gguf": make_gguf(hf, root / "gguf" / "draft.gguf", "LEGACY")}


def _big_model_overrides(name: str, tiny_gguf, foreign_draft) -> dict:
    """The Qwen2.5-Coder configs and the Llama one, every key as shipped but the
    models: a tiny Q4_K_M target of the family and a draft of other block types
    (the packages hold 1.6 GB; benchmarks/check_pair.py runs the real pair), or of
    another tokenizer where the shipped draft is another family's, and a draft head
    that fits the tiny vocabulary."""
    cfg = load_config(PACKAGED / name)
    out = {"target.model": str(tiny_gguf("llama-wide" if name.startswith("llama") else "qwen2-wide", "Q4_K_M"))}
    if cfg.drafter.kind == "model" or (cfg.drafter.kind == "hybrid" and cfg.drafter.hybrid_with == "model"):
        same_family = cfg.drafter.model is None or cfg.drafter.model.startswith("qwen")
        foreign = foreign_draft["gguf" if cfg.drafter.precision == "gguf" else "hf"]
        out["drafter.model"] = str(tiny_gguf("qwen2-wide", "LEGACY") if same_family else foreign)
        if cfg.drafter.vocab:
            out["drafter.vocab"] = 200
    return out


@pytest.mark.parametrize("name", [n for n in ALL if n not in ACCELERATOR_ONLY])
def test_runs_losslessly_here(name, tiny_gguf, foreign_draft):
    import os

    overrides = OVERRIDES.get(name) or (_big_model_overrides(name, tiny_gguf, foreign_draft)
                                        if name.startswith(("qwen", "llama")) else None)
    affinity = os.sched_getaffinity(0)
    engine = Engine.from_config(load_config(PACKAGED / name, overrides))
    try:
        assert (engine.plan is not None) == (name == "auto.yaml")
        if name.endswith("-smol.yaml"):  # SmolLM2 drafting for another family: the draft of another tokenizer
            from hetero_sd.drafting.cross_vocab import CrossVocabDrafter

            assert isinstance(engine.drafter, CrossVocabDrafter)
        prompt = "Repeat exactly: red green blue, red green blue, red green blue."
        spec = engine.generate(prompt, max_new_tokens=12)
        base = engine.generate(prompt, max_new_tokens=12, target_only=True)
        assert spec.token_ids == base.token_ids and spec.stats.lossless == "exact"
        engine.close()
        assert os.sched_getaffinity(0) == affinity  # a worker config with cpus gives them back on close
    finally:
        engine.close()
        os.sched_setaffinity(0, affinity)  # (only where the assertion above failed)
