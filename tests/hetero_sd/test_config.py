"""YAML configuration: packaged files, byte sizes, dotted overrides, relative model paths."""
from __future__ import annotations

import importlib.resources
import shutil
from pathlib import Path

import pytest

from hetero_sd.config import (
    PACKAGED,
    Config,
    DrafterConfig,
    GenerationConfig,
    MemoryConfig,
    ModelPlacement,
    load_config,
    resolve_model,
)
from hetero_sd.errors import ConfigError, HeteroSDError


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# ------------------------------------------------------------------ packaged configs
def test_packaged_cpu_yaml_loads_into_typed_sections():
    cfg = load_config(PACKAGED / "cpu.yaml")
    assert isinstance(cfg, Config)
    assert isinstance(cfg.target, ModelPlacement)
    assert isinstance(cfg.drafter, DrafterConfig)
    assert isinstance(cfg.generation, GenerationConfig)
    assert isinstance(cfg.memory, MemoryConfig)
    assert (cfg.target.model, cfg.target.backend, cfg.target.device, cfg.target.precision) == (
        "default", "onnxruntime", "cpu", "gguf")
    d = cfg.drafter
    assert (d.kind, d.k, d.k_max) == ("suffix", "auto", 8)
    assert cfg.generation.max_new_tokens == 128
    assert cfg.generation.stop == []
    assert cfg.generation.chat_template is True
    assert cfg.memory.kv_budget == 256 * 2**20
    assert cfg.source == str(PACKAGED / "cpu.yaml")


def test_no_path_means_the_packaged_cpu_yaml():
    assert load_config() == load_config(PACKAGED / "cpu.yaml")
    assert Path(load_config().source).name == "cpu.yaml"


def test_packaged_cpu_draft_model_yaml():
    cfg = load_config(PACKAGED / "cpu-draft-model.yaml")
    assert (cfg.target.model, cfg.target.backend, cfg.target.device, cfg.target.precision) == (
        "default", "torch", "cpu", "fp32")
    d = cfg.drafter
    assert (d.kind, d.model, d.backend, d.device, d.precision, d.k) == (
        "model", "default", "onnxruntime", "cpu", "int4", 4)
    assert cfg.generation.max_new_tokens == 128
    assert cfg.memory.kv_budget == 256 * 2**20


def test_packaged_configs_are_found_where_the_package_installs_them():
    """PACKAGED must be the `hetero_sd.configs` package data folder (in a wheel that is
    site-packages/hetero_sd/configs, not a `configs` folder next to the hetero_sd package)."""
    resources = Path(str(importlib.resources.files("hetero_sd.configs")))
    assert (resources / "cpu.yaml").is_file()
    assert PACKAGED.resolve() == resources.resolve()


def test_defaults_without_a_file_match_the_documented_defaults():
    cfg = Config()
    assert cfg.source == "<defaults>"
    assert cfg.target.model == "default" and cfg.target.precision == "default"
    assert cfg.drafter.kind == "ngram" and cfg.drafter.k == 5
    assert cfg.memory.kv_budget == 256 * 2**20


def test_empty_file_gives_the_defaults(tmp_path):
    # (environ={}: no old HETERO_SD_* switch setting an `options:` default, as the suite's conftest does)
    cfg = load_config(write(tmp_path / "empty.yaml", ""), environ={})
    assert cfg.model_dump() == Config().model_dump()
    assert cfg.source == str(tmp_path / "empty.yaml")


def test_sections_are_frozen():
    cfg = load_config()
    with pytest.raises(Exception):
        cfg.drafter.k = 3  # type: ignore[misc]


# ------------------------------------------------------------------ memory.kv_budget
@pytest.mark.parametrize("value, expected", [
    ("256MiB", 256 * 2**20),
    ("1GiB", 2**30),
    (1048576, 1048576),
    ("1048576", 1048576),
    ("64KiB", 64 * 1024),
    ("512 KiB", 512 * 1024),
    ("1.5GiB", 3 * 2**29),
    ("2MB", 2_000_000),
    ("3kb", 3000),
    ("100B", 100),
    ("1gib", 2**30),
])
def test_kv_budget_accepts_bytes_and_units(tmp_path, value, expected):
    assert MemoryConfig(kv_budget=value).kv_budget == expected
    path = write(tmp_path / "c.yaml", f"memory:\n  kv_budget: {value}\n")
    assert load_config(path).memory.kv_budget == expected


@pytest.mark.parametrize("value", ["12 parsecs", "MiB", "1.2.3GiB", "-5MiB", "lots"])
def test_kv_budget_rejects_nonsense_naming_the_key(tmp_path, value):
    path = write(tmp_path / "bad-budget.yaml", f"memory:\n  kv_budget: {value}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    msg = str(info.value)
    assert "memory.kv_budget" in msg
    assert "bad-budget.yaml" in msg
    assert repr(value) in msg  # the offending value, quoted
    assert "'512MiB'" in msg and "'1GiB'" in msg  # what would have been accepted


def test_config_error_is_a_hetero_sd_error():
    assert issubclass(ConfigError, HeteroSDError)


# ------------------------------------------------------------------ dotted overrides
def test_dotted_override_replaces_a_value(tmp_path):
    path = write(tmp_path / "c.yaml", "generation:\n  max_new_tokens: 50\n  chat_template: false\n")
    cfg = load_config(path, {"generation.max_new_tokens": 7})
    assert cfg.generation.max_new_tokens == 7
    assert cfg.generation.chat_template is False  # siblings untouched


def test_dotted_override_of_the_packaged_default():
    cfg = load_config(None, {"generation.max_new_tokens": 7, "drafter.k": 3, "memory.kv_budget": "1MiB"})
    assert cfg.generation.max_new_tokens == 7
    assert cfg.drafter.k == 3
    assert cfg.memory.kv_budget == 2**20
    assert cfg.target.precision == "gguf"  # the rest still comes from cpu.yaml


def test_dotted_override_creates_a_missing_section(tmp_path):
    path = write(tmp_path / "c.yaml", "target:\n  device: cpu\n")
    cfg = load_config(path, {"drafter.kind": "none", "generation.stop": ["\n\n"]})
    assert cfg.drafter.kind == "none"
    assert cfg.generation.stop == ["\n\n"]


def test_none_overrides_are_ignored(tmp_path):
    """The CLI passes None for options the user did not give."""
    path = write(tmp_path / "c.yaml", "generation:\n  max_new_tokens: 50\n")
    assert load_config(path, {"generation.max_new_tokens": None}).generation.max_new_tokens == 50


def test_overrides_are_validated_like_the_file(tmp_path):
    path = write(tmp_path / "c.yaml", "generation:\n  max_new_tokens: 50\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, {"generation.max_new_tokens": 0})
    assert "generation.max_new_tokens" in str(info.value)
    assert "greater than or equal to 1" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(path, {"generation.max_tokens": 5})
    assert "generation.max_tokens" in str(info.value) and "max_new_tokens" in str(info.value)


def test_override_does_not_modify_the_file(tmp_path):
    path = write(tmp_path / "c.yaml", "generation:\n  max_new_tokens: 50\n")
    load_config(path, {"generation.max_new_tokens": 7})
    assert load_config(path).generation.max_new_tokens == 50


def test_override_into_an_empty_section(tmp_path):
    path = write(tmp_path / "c.yaml", "generation:\n")
    assert load_config(path, {"generation.max_new_tokens": 7}).generation.max_new_tokens == 7


# ------------------------------------------------------------------ model paths
def test_relative_model_path_is_resolved_against_the_yaml_folder(tmp_path, monkeypatch):
    model = tmp_path / "project" / "models" / "tiny"
    model.mkdir(parents=True)
    cfg_path = write(tmp_path / "project" / "configs" / "c.yaml", "target:\n  model: ../models/tiny\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(cfg_path)
    assert cfg.target.model == "../models/tiny"  # stored as written
    resolved = resolve_model(cfg.target.model, Path(cfg.source).parent)
    assert resolved.resolve() == model.resolve()


def test_relative_model_path_not_next_to_the_yaml_stays_relative_to_cwd(tmp_path, monkeypatch):
    (tmp_path / "cwd" / "m").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "cwd")
    resolved = resolve_model("m", tmp_path / "configs")
    assert resolved == Path("m")
    assert resolved.resolve() == (tmp_path / "cwd" / "m").resolve()


def test_absolute_and_home_model_paths(tmp_path, monkeypatch):
    assert resolve_model(str(tmp_path / "x"), tmp_path / "other") == tmp_path / "x"
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_model("~/models/m", None) == tmp_path / "models" / "m"


def test_build_engine_uses_the_yaml_relative_model_path(tmp_path, monkeypatch, tiny_model_dir):
    from hetero_sd.engine import Engine

    shutil.copytree(tiny_model_dir("llama"), tmp_path / "project" / "models" / "tiny")
    cfg_path = write(tmp_path / "project" / "conf" / "tiny.yaml",
                     "target:\n  model: ../models/tiny\ngeneration:\n  max_new_tokens: 3\n")
    monkeypatch.chdir(tmp_path)  # not the YAML's folder
    engine = Engine.from_config(load_config(cfg_path))
    result = engine.generate_ids([0, 10, 20, 30])
    assert len(result.token_ids) <= 3
    assert result.stats.finish_reason in ("length", "eos")


def test_min_ngram_above_max_ngram_names_both(tmp_path):
    path = write(tmp_path / "ngram.yaml", "drafter:\n  min_ngram: 5\n  max_ngram: 3\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    msg = str(info.value)
    assert "ngram.yaml" in msg
    assert "drafter.min_ngram (5)" in msg and "drafter.max_ngram (3)" in msg


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "nope.yaml")
    assert "nope.yaml" in str(info.value) and "does not exist" in str(info.value)
