"""Hugging Face ids (hetero_sd/hub.py): ORG/NAME[@REVISION][:FILE] resolved through
huggingface_hub's cache, offline; clear errors naming the folder; the cache listing.

Each test builds its own hub cache (models--ORG--NAME/{blobs,refs,snapshots}, as
huggingface_hub writes it) under tmp_path; nothing touches the network."""
from __future__ import annotations

import json
import hashlib
import os
import shutil
import socket
from pathlib import Path

import pytest

from hetero_sd import hub
from hetero_sd.errors import ConfigError
from hetero_sd.ir import load_model_ir

A = "a" * 40  # commit hashes
B = "b" * 40
C = "c" * 40


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty hub cache in HF_HUB_CACHE, offline, with sockets refused (no network, ever)."""
    root = tmp_path / "hf" / "hub"
    for var in ("HF_HOME", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def refuse(*args, **kwargs):
        raise AssertionError(f"a test tried the network: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    return root


def put_repo(cache: Path, repo: str, files: dict[str, Path | bytes], commit: str = A,
             refs: tuple[str, ...] = ("main",), blobs: bool = True) -> Path:
    """Add a snapshot of `repo` at `commit` to the cache, as huggingface_hub lays it out:
    blobs/<sha256>, snapshots/<commit>/<path> a relative symlink to its blob, refs/<ref>
    holding the commit (no newline). blobs=False: plain files in the snapshot."""
    folder = cache / ("models--" + repo.replace("/", "--"))
    snapshot = folder / "snapshots" / commit
    for rel, content in files.items():
        data = content.read_bytes() if isinstance(content, Path) else content
        dest = snapshot / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        if blobs:
            blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
            blob.parent.mkdir(parents=True, exist_ok=True)
            blob.write_bytes(data)
            dest.symlink_to(os.path.relpath(blob, dest.parent))
        else:
            dest.write_bytes(data)
    for ref in refs:
        (folder / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (folder / "refs" / ref).write_text(commit)
    return snapshot


def folder_files(folder: Path) -> dict[str, Path]:
    return {p.relative_to(folder).as_posix(): p for p in folder.rglob("*") if p.is_file()}


# ------------------------------------------------------------------ syntax
@pytest.mark.parametrize("text, parts", [
    ("Qwen/Qwen2.5-0.5B-Instruct", ("Qwen/Qwen2.5-0.5B-Instruct", None, None)),
    ("org/name@v1.0", ("org/name", "v1.0", None)),
    (f"org/name@{A}", ("org/name", A, None)),
    ("org/name:Q4_K_M", ("org/name", None, "Q4_K_M")),
    ("org/name-GGUF:sub/model-Q8_0.gguf", ("org/name-GGUF", None, "sub/model-Q8_0.gguf")),
    ("org/name@refs/pr/3:model.gguf", ("org/name", "refs/pr/3", "model.gguf")),
])
def test_an_id_splits_into_repo_revision_and_file(text, parts):
    hub_id = hub.parse(text)
    assert (hub_id.repo, hub_id.revision, hub_id.file) == parts
    assert str(hub_id) == text


@pytest.mark.parametrize("text", [
    "smollm2-135m", "model.gguf", "./org/name", "../org/name", "~/org/name", "/abs/org/name", "a/b/c",
    "org/name.gguf", "models/x.safetensors", "C:/models/x", "org/name:", "org/name@", "org /name", "org/",
    "-org/name", "org/na..me", "org--x/name",
])
def test_paths_and_names_are_not_hub_ids(text, cache):
    assert not hub.looks_like_hub_id(text)


def test_an_existing_relative_path_stays_a_path(tmp_path, monkeypatch, cache):
    monkeypatch.chdir(tmp_path)
    assert hub.looks_like_hub_id("models/x")
    (tmp_path / "models" / "x").mkdir(parents=True)
    assert not hub.looks_like_hub_id("models/x")
    # relative to a config's folder
    assert hub.looks_like_hub_id("conf/y")
    (tmp_path / "cfgdir" / "conf" / "y").mkdir(parents=True)
    assert not hub.looks_like_hub_id("conf/y", relative_to=tmp_path / "cfgdir")


def test_the_cache_folder_follows_huggingface_hubs_precedence(tmp_path, monkeypatch):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert hub.hub_cache_dir() == tmp_path / "home" / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub.hub_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hfhome"))
    assert hub.hub_cache_dir() == tmp_path / "hfhome" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", "~/elsewhere")
    assert hub.hub_cache_dir() == tmp_path / "home" / "elsewhere"
    for value, expected in (("1", True), ("true", True), ("0", False), ("", False)):
        monkeypatch.setenv("HF_HUB_OFFLINE", value)
        assert hub.offline() is expected


# ------------------------------------------------------------------ resolution, offline
def test_a_safetensors_repo_resolves_to_its_snapshot_and_loads(cache, tiny_model_dir):
    snapshot = put_repo(cache, "org/tiny-llama", folder_files(tiny_model_dir("llama")))
    path = hub.resolve("org/tiny-llama")
    assert path == snapshot
    ir = load_model_ir(path)
    assert ir.fmt == "hf" and ir.source == snapshot
    assert ir.weights.get("model.embed_tokens.weight").shape[0] == ir.config.vocab_size
    assert hub.resolve("org/tiny-llama", revision="main") == snapshot  # the default branch by name
    assert hub.resolve(f"org/tiny-llama@{A}") == snapshot  # and by commit hash


def test_plain_files_in_a_snapshot_work_too(cache, tiny_model_dir):
    put_repo(cache, "org/plain", folder_files(tiny_model_dir("llama")), blobs=False)
    assert load_model_ir(hub.resolve("org/plain")).fmt == "hf"


def test_a_gguf_repo_resolves_to_its_single_gguf_file_and_loads(cache, tiny_gguf):
    gguf = tiny_gguf("llama", "Q8_0")
    snapshot = put_repo(cache, "org/tiny-GGUF", {"README.md": b"# tiny\n", "tiny-Q8_0.gguf": gguf})
    path = hub.resolve("org/tiny-GGUF")
    assert path == snapshot / "tiny-Q8_0.gguf"
    ir = load_model_ir(path)
    assert ir.fmt == "gguf" and ir.config.vocab_size > 0


def test_a_hub_gguf_loads_once_its_symlink_is_resolved(cache, tiny_gguf):
    """load_model_ir knows a GGUF by its magic, not only by a .gguf ending (a blob has none)."""
    put_repo(cache, "org/linked-GGUF", {"tiny-Q8_0.gguf": tiny_gguf("llama", "Q8_0")})
    blob = hub.resolve("org/linked-GGUF").resolve()  # what hetero_sd/loading.py's Loader.ir does
    assert blob.parent.name == "blobs"
    assert load_model_ir(blob).fmt == "gguf"


def test_a_gguf_among_several_is_picked_by_file_name_path_or_quant_tag(cache, tiny_gguf):
    f32, q8 = tiny_gguf("llama", "F32"), tiny_gguf("llama", "Q8_0")
    snapshot = put_repo(cache, "org/multi-GGUF", {"tiny-F32.gguf": f32, "quants/tiny-Q8_0.gguf": q8,
                                                  "tiny-IQ8_0.gguf": q8})
    with pytest.raises(ConfigError) as err:
        hub.resolve("org/multi-GGUF")
    assert "3 .gguf files" in str(err.value) and "quants/tiny-Q8_0.gguf" in str(err.value)
    assert "org/multi-GGUF:FILE" in str(err.value)
    assert hub.resolve("org/multi-GGUF:quants/tiny-Q8_0.gguf") == snapshot / "quants" / "tiny-Q8_0.gguf"
    assert hub.resolve("org/multi-GGUF:tiny-Q8_0.gguf") == snapshot / "quants" / "tiny-Q8_0.gguf"
    assert hub.resolve("org/multi-GGUF:q8_0") == snapshot / "quants" / "tiny-Q8_0.gguf"  # not IQ8_0
    assert hub.resolve("org/multi-GGUF:F32") == snapshot / "tiny-F32.gguf"
    assert load_model_ir(hub.resolve("org/multi-GGUF:Q8_0")).fmt == "gguf"
    with pytest.raises(ConfigError) as err:
        hub.resolve("org/multi-GGUF:Q4_K_M")
    msg = str(err.value)
    assert "'Q4_K_M' is not among the .gguf files" in msg and str(cache) in msg
    assert "hf download org/multi-GGUF --include '*Q4_K_M*'" in msg


def test_a_revision_pinned_by_name(cache, tiny_gguf):
    main = put_repo(cache, "org/pinned", {"m.gguf": tiny_gguf("llama", "F32")}, commit=A, refs=("main",))
    old = put_repo(cache, "org/pinned", {"m.gguf": tiny_gguf("llama", "Q8_0")}, commit=B, refs=("v1.0",))
    assert hub.resolve("org/pinned") == main / "m.gguf"
    assert hub.resolve("org/pinned@v1.0") == old / "m.gguf"
    assert hub.resolve("org/pinned", revision="v1.0") == old / "m.gguf"
    assert hub.resolve("org/pinned@v1.0", revision="v1.0") == old / "m.gguf"
    assert hub.resolve(f"org/pinned@{B}:m.gguf") == old / "m.gguf"
    with pytest.raises(ConfigError, match="pins revision 'v1.0' but `revision:` says 'main'"):
        hub.resolve("org/pinned@v1.0", revision="main")
    with pytest.raises(ConfigError) as err:
        hub.resolve("org/pinned@v2.0")
    assert "no snapshot of revision 'v2.0'" in str(err.value)
    assert "hf download org/pinned --revision v2.0" in str(err.value)


def test_a_missing_model_names_the_folder_it_looked_in_and_how_to_download(cache):
    with pytest.raises(ConfigError) as err:
        hub.resolve("org/absent")
    msg = str(err.value)
    assert str(cache) in msg and str(cache / "models--org--absent") in msg
    assert "hf download org/absent" in msg and "download: true" in msg and "HF_HUB_OFFLINE" in msg


def test_offline_download_true_refuses_without_trying(cache, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "list_repo_files", lambda *a, **k: pytest.fail("listed the Hub"))
    with pytest.raises(ConfigError, match="unset HF_HUB_OFFLINE"):
        hub.resolve("org/absent", download=True)


def test_an_incomplete_sharded_snapshot_is_not_used(cache, tiny_model_dir):
    files = folder_files(tiny_model_dir("llama", shards=2))
    snapshot = put_repo(cache, "org/sharded", files)
    assert hub.resolve("org/sharded") == snapshot
    lost = next(p for p in sorted(snapshot.glob("model-*.safetensors")))
    lost.resolve().unlink()  # its blob gone (an interrupted download): a dangling link
    with pytest.raises(ConfigError) as err:
        hub.resolve("org/sharded")
    assert f"shards missing: {lost.name}" in str(err.value) and "hf download org/sharded" in str(err.value)


def test_a_partial_download_of_a_gguf_repo_is_used(cache, tiny_gguf):
    """snapshot_download(allow_patterns=...) (hetero-sd's download, or `hf download --include`)
    records the whole repo's tree listing, but fetches one quant: huggingface_hub then calls
    the snapshot incomplete; the file asked for is there, so it is used."""
    import json

    snapshot = put_repo(cache, "org/part-GGUF", {"m-Q8_0.gguf": tiny_gguf("llama", "Q8_0")})
    trees = cache / "models--org--part-GGUF" / "trees"
    trees.mkdir()
    listing = {name: {"size": 1, "blob_id": "0" * 40} for name in ("m-Q8_0.gguf", "m-F32.gguf", "README.md")}
    (trees / f"{A}.json").write_text(json.dumps({"format_version": 1, "files": listing}))
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError

    with pytest.raises(IncompleteSnapshotError):  # what hub.resolve gets, and gets past
        snapshot_download("org/part-GGUF", cache_dir=cache, local_files_only=True)
    assert hub.resolve("org/part-GGUF:Q8_0") == snapshot / "m-Q8_0.gguf"
    assert hub.resolve("org/part-GGUF") == snapshot / "m-Q8_0.gguf"  # the one .gguf on disk
    with pytest.raises(ConfigError, match="'F32' is not among the .gguf files"):
        hub.resolve("org/part-GGUF:F32")


def test_a_repo_with_no_model_in_it_says_so(cache):
    put_repo(cache, "org/readme-only", {"README.md": b"hi", "pytorch_model.bin": b"\0"})
    with pytest.raises(ConfigError, match="neither a safetensors model"):
        hub.resolve("org/readme-only")


def test_not_an_id_is_refused():
    with pytest.raises(ConfigError, match="not a Hugging Face id"):
        hub.resolve("./x")


# ------------------------------------------------------------------ download (opt-in; a fake Hub)
@pytest.fixture
def fake_hub(cache, monkeypatch, tiny_gguf):
    """huggingface_hub's list_repo_files and (online) snapshot_download replaced by a fake Hub
    that copies from a folder: records what was asked; local look-ups stay real."""
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE")
    remote = {"README.md": b"# r\n", "m-F32.gguf": tiny_gguf("llama", "F32"),
              "m-Q8_0.gguf": tiny_gguf("llama", "Q8_0")}
    asked: list[dict] = []
    real = huggingface_hub.snapshot_download

    def snapshot_download(repo_id, **kw):
        if kw.get("local_files_only"):
            return real(repo_id, **kw)
        asked.append({"repo": repo_id, **kw})
        wanted = {k: v for k, v in remote.items() if k in kw["allow_patterns"]}
        return str(put_repo(Path(kw["cache_dir"]), repo_id, wanted, commit=C))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(huggingface_hub, "list_repo_files", lambda repo_id, revision=None: list(remote))
    return asked


def test_download_true_fetches_only_the_chosen_gguf(cache, fake_hub):
    with pytest.raises(ConfigError, match="not in the Hugging Face cache"):
        hub.resolve("org/remote:Q8_0")  # download not asked for: nothing fetched
    assert fake_hub == []
    path = hub.resolve("org/remote:Q8_0", download=True, progress=False)
    assert path == cache / "models--org--remote" / "snapshots" / C / "m-Q8_0.gguf"
    assert [(a["repo"], a["allow_patterns"], a["cache_dir"]) for a in fake_hub] == \
        [("org/remote", ["m-Q8_0.gguf"], cache)]
    assert hub.resolve("org/remote:Q8_0") == path  # cached now: no download
    assert len(fake_hub) == 1
    with pytest.raises(ConfigError, match="holds 2 .gguf files"):  # the listing says which to pick
        hub.resolve("org/other", download=True)


def test_the_files_a_download_takes():
    listing = ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
               "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "merges.txt",
               "generation_config.json", "pytorch_model.bin", "onnx/model.onnx", "onnx/config.json",
               "original/consolidated.safetensors", "README.md", ".gitattributes", "chat_template.jinja"]
    assert hub.wanted_files(listing, hub.parse("o/n")) == [
        "config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "merges.txt",
        "generation_config.json", "chat_template.jinja"]
    ggufs = ["a-Q4_K_M.gguf", "a-Q4_K_S.gguf", "a-IQ4_K_M.gguf", "README.md"]
    assert hub.wanted_files(ggufs, hub.parse("o/n:Q4_K_M")) == ["a-Q4_K_M.gguf"]
    with pytest.raises(ConfigError, match="matches none"):
        hub.wanted_files(ggufs, hub.parse("o/n:Q4_K"))
    with pytest.raises(ConfigError, match="holds 3 .gguf files"):
        hub.wanted_files(ggufs, hub.parse("o/n"))
    assert hub.wanted_files(["x.gguf", "README.md"], hub.parse("o/n")) == ["x.gguf"]


# ------------------------------------------------------------------ listing
def test_the_listing_finds_safetensors_and_gguf_repos(cache, tiny_model_dir, tiny_gguf):
    assert hub.cached_models() == []  # no cache folder yet: nothing, no error
    st = put_repo(cache, "org/tiny-llama", folder_files(tiny_model_dir("llama")))
    gg = put_repo(cache, "Org/tiny-GGUF", {"q/tiny-Q8_0.gguf": tiny_gguf("llama", "Q8_0")}, commit=A)
    put_repo(cache, "Org/tiny-GGUF", {"tiny-F32.gguf": tiny_gguf("llama", "F32")}, commit=B, refs=("v1",))
    put_repo(cache, "org/not-a-model", {"README.md": b"x"})
    rows = hub.cached_models()
    assert [r["id"] for r in rows] == ["Org/tiny-GGUF", "org/tiny-llama"]  # sorted, case aside
    gguf_row, st_row = rows
    assert (st_row["format"], st_row["path"], st_row["gguf"]) == ("safetensors", str(st), [])
    assert st_row["size"] == sum(p.stat().st_size for p in tiny_model_dir("llama").iterdir() if p.is_file())
    assert (gguf_row["format"], gguf_row["path"], gguf_row["gguf"]) == ("gguf", str(gg), ["q/tiny-Q8_0.gguf"])
    assert sorted((r["commit"], tuple(r["refs"])) for r in gguf_row["revisions"]) == [(A, ("main",)), (B, ("v1",))]
    assert rows == hub.cached_models(cache)  # an explicit folder is the same

    from rich.console import Console

    console = Console(record=True, width=400)
    console.print(hub.models_table(rows))
    text = console.export_text()
    for shown in ("org/tiny-llama", "Org/tiny-GGUF", "q/tiny-Q8_0.gguf", "main, v1", str(st), "ORG/NAME[@REVISION][:FILE]"):
        assert shown in text


def test_the_listing_of_another_cache_folder(tmp_path, cache):
    other = tmp_path / "other"
    shutil.copytree(put_repo(cache, "org/x", {"x.gguf": b"GGUF"}).parents[1], other / "models--org--x",
                    symlinks=True)
    assert [r["id"] for r in hub.cached_models(other)] == ["org/x"]


def test_a_config_names_a_hub_id(cache, tiny_model_dir, tiny_gguf, tmp_path):
    """`model: ORG/NAME` (and -m ORG/NAME) runs end to end from the cache, offline."""
    from hetero_sd.config import load_config
    from hetero_sd.engine import Engine

    put_repo(cache, "org/tiny-GGUF", {"tiny-F32.gguf": tiny_gguf("llama", "F32")})
    outs = []
    for model in ("org/tiny-GGUF", str(tiny_gguf("llama", "F32"))):
        path = tmp_path / "c.yaml"
        path.write_text(f"target: {{model: {model}, backend: torch, precision: fp32}}\n"
                        "drafter: {kind: ngram, k: 3}\nmemory: {kv_budget: 4MiB}\n")
        engine = Engine.from_config(load_config(path))
        try:
            outs.append(engine.generate_ids([1, 5, 9, 5, 9], 6).token_ids)
        finally:
            engine.close()
    assert outs[0] == outs[1]


def test_the_models_command_lists_the_hub_cache(cache, tiny_gguf, capsys):
    from hetero_sd.cli import main

    put_repo(cache, "org/tiny-GGUF", {"tiny-F32.gguf": tiny_gguf("llama", "F32")})
    assert main(["models", "--json"]) == 0
    hub_rows = json.loads(capsys.readouterr().out)["hub"]
    assert [r["id"] for r in hub_rows] == ["org/tiny-GGUF"] and hub_rows[0]["format"] == "gguf"
    assert main(["models"]) == 0
    assert "org/tiny-GGUF" in capsys.readouterr().out
