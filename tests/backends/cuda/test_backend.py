"""The cuda backend as a user meets it: found by the registry, listed by `hetero-sd
devices`, loaded from a YAML config, and every bad input refused with what to do."""
from __future__ import annotations

import textwrap

import pytest

from hetero_sd.backends import base
from hetero_sd.backends.cuda import backend as cuda_backend
from hetero_sd.backends.cuda import runner as cuda_runner
from hetero_sd.backends.registry import discover
from hetero_sd.engine import Engine
from hetero_sd.errors import BackendError
from hetero_sd.ir import load_model_ir
from helpers.tiny_models import random_prompt

from .conftest import DEVICE, cuda_device


def test_registered_and_listed():
    """Found by the registry (as `hetero-sd devices` finds it), every precision exact."""
    registry = discover()
    assert "cuda" in registry.backends, registry.broken.get("cuda")
    rows = registry.get("cuda").probe()
    assert DEVICE in [r.device for r in rows]
    for row in rows:
        assert {p.name for p in row.precisions} >= {"fp16", "fp32", "gguf"}
        assert all(p.batch_invariant for p in row.precisions)


def test_absent_device_names_those_here(tiny_model_dir):
    with pytest.raises(BackendError) as err:
        cuda_backend.CudaBackend().load(load_model_ir(tiny_model_dir("llama")), "cuda:3", "fp32", 1 << 20)
    assert "cuda:3" in str(err.value) and f"available: " in str(err.value) and DEVICE in str(err.value)


def test_missing_runtime_says_what_to_install(monkeypatch, tiny_model_dir):
    monkeypatch.setattr(cuda_backend, "_runtime", lambda: None)
    assert cuda_backend.CudaBackend().probe() == []
    with pytest.raises(BackendError, match="needs torch and Triton.*pip install triton"):
        cuda_backend.CudaBackend().load(load_model_ir(tiny_model_dir("llama")), "cuda:0", "bf16", 1 << 20)


def test_precision_the_device_lacks_is_named():
    precs, lacks = cuda_backend._precisions(bf16=False)
    info = base.DeviceInfo("cuda", "cuda:0", "Tesla V100 (compute capability 7.0)", precs, "fp16", lacks)
    with pytest.raises(BackendError, match=r"lacks precision 'bf16': needs compute capability 8\.0.*supported: fp16"):
        base.resolve([info], "cuda", "cuda:0", "bf16")
    assert base.resolve([info], "cuda", "cuda:0", "default")[1].name == "fp16"


def test_model_too_big_is_refused_before_loading(monkeypatch, tiny_model_dir):
    ir = load_model_ir(tiny_model_dir("llama"))
    read = []
    monkeypatch.setattr(cuda_runner, "free_bytes", lambda device: (1 << 20, 80 << 30))
    monkeypatch.setattr(type(ir.weights), "get", lambda self, name: read.append(name))
    with pytest.raises(BackendError) as err:
        cuda_backend.CudaBackend().load(ir, cuda_device(), "fp32", 4 << 20)
    msg = str(err.value)
    assert "does not fit" in msg and "KV pool 0.00" in msg and "GiB free of 80.00 GiB" in msg
    assert "weights" in msg and "memory.kv_budget" in msg
    assert read == []  # refused before a single tensor was read


def test_engine_from_yaml(tiny_model_dir, tmp_path):
    """configs name it like any backend; results say the target is exact."""
    cfg = tmp_path / "cuda.yaml"
    cfg.write_text(textwrap.dedent(f"""\
        target: {{model: {tiny_model_dir('llama')}, backend: cuda, device: {DEVICE}, precision: fp32}}
        drafter: {{kind: ngram, k: 3}}
        generation: {{max_new_tokens: 6, temperature: 0}}
        memory: {{kv_budget: 2MiB}}
        """))
    engine = Engine.from_config(cfg)
    prompt = random_prompt(5, seed=9) * 2
    spec = engine.generate_ids(prompt, 6)
    assert spec.token_ids == engine.generate_ids(prompt, 6, target_only=True).token_ids
    assert spec.stats.lossless == "exact"
