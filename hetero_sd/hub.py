"""Models from the Hugging Face Hub, by id, through huggingface_hub's cache.

    model: Qwen/Qwen2.5-0.5B-Instruct                          # a safetensors repo: its snapshot folder
    model: Qwen/Qwen2.5-0.5B-Instruct@v1.0                     # pinned: a branch, a tag or a commit hash
    model: bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M          # a GGUF repo: the one file of that quant
    model: bartowski/SmolLM2-135M-Instruct-GGUF:SmolLM2-135M-Instruct-Q8_0.gguf
    model: ORG/NAME@REVISION:FILE.gguf                          # both

The syntax is ORG/NAME[@REVISION][:FILE]. FILE picks a .gguf in the repo: its path in
the repo, its file name, or a quant tag such as Q4_K_M that exactly one file name holds.
Without FILE a repo resolves to its snapshot folder when that holds a safetensors model
(config.json and *.safetensors), else to its single .gguf file.

The cache is huggingface_hub's (`hf download` fills the same one), found as it finds it:
$HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub. The environment is read
at each call, not when huggingface_hub was imported. A cached snapshot is used as it is,
without asking the Hub whether a branch moved (no network at start). Nothing is downloaded
unless asked (`download=True`; a config's `download: true`), and never under HF_HUB_OFFLINE=1:
a model missing then is an error that names the folder looked in and the command that
downloads it.
"""
from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from hetero_sd.errors import ConfigError, ModelLoadError

# A Hub repo id: ORG/NAME, letters, digits, '-', '_', '.', each part starting with a letter or digit.
_REPO = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}"
# A revision: anything a git ref or commit allows but ':' (git forbids it in ref names) and blanks.
_ID = re.compile(rf"(?P<repo>{_REPO})(?:@(?P<revision>[^:\s]+))?(?::(?P<file>[^\s]+))?")
# Names that are files, not repos: "models/x.gguf" that does not exist is a missing file.
_FILE_SUFFIXES = (".gguf", ".safetensors", ".json", ".bin", ".onnx", ".yaml", ".yml")
_TRUE = {"1", "ON", "YES", "TRUE"}  # huggingface_hub.constants.ENV_VARS_TRUE_VALUES
DEFAULT_REVISION = "main"


@dataclass(frozen=True)
class HubId:
    repo: str  # ORG/NAME
    revision: str | None  # a branch, tag or commit hash; None: the default branch
    file: str | None  # a .gguf path, file name or quant tag in the repo

    def __str__(self) -> str:
        return self.repo + (f"@{self.revision}" if self.revision else "") + (f":{self.file}" if self.file else "")


def parse(text: str) -> HubId | None:
    """ORG/NAME[@REVISION][:FILE] split into its parts, or None when it is not of that form."""
    m = _ID.fullmatch(text.strip())
    if m is None:
        return None
    repo = m["repo"]
    if ".." in repo or "--" in repo or repo.lower().endswith(_FILE_SUFFIXES):
        return None
    return HubId(repo, m["revision"], m["file"])


def looks_like_hub_id(text: str, relative_to: Path | None = None) -> bool:
    """ORG/NAME[@REVISION][:FILE] that is not an existing local path (here, or under
    `relative_to`, a config's folder): "models/x" on disk stays a path. Cheap: no import
    of huggingface_hub, no look at the cache."""
    if parse(text) is None:
        return False
    local = Path(text).expanduser()
    return not (local.exists() or (relative_to is not None and not local.is_absolute()
                                   and (relative_to / local).exists()))


# ------------------------------------------------------------------ environment
def hub_cache_dir() -> Path:
    """huggingface_hub's cache folder as its documented precedence gives it, read now:
    HF_HUB_CACHE, (legacy) HUGGINGFACE_HUB_CACHE, HF_HOME/hub, XDG_CACHE_HOME/huggingface/hub,
    ~/.cache/huggingface/hub. (huggingface_hub.constants froze these at its import.)"""
    env = os.environ
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
    hub = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return Path(os.path.expandvars(os.path.expanduser(hub)))


def offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set to 1/ON/YES/TRUE, read now."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    return value is not None and value.upper() in _TRUE


def repo_folder(repo: str, cache_dir: Path | None = None) -> Path:
    """Where the cache keeps a model repo: <cache>/models--ORG--NAME."""
    return (hub_cache_dir() if cache_dir is None else Path(cache_dir)) / ("models--" + repo.replace("/", "--"))


def download_command(hub_id: HubId) -> str:
    """The `hf download` command (huggingface_hub's CLI) that fetches what `hub_id` names."""
    rev = f" --revision {hub_id.revision}" if hub_id.revision else ""
    name = f" --include '*{hub_id.file}*'" if hub_id.file else ""
    return f"hf download {hub_id.repo}{name}{rev}"


# ------------------------------------------------------------------ resolution
class _NotUsable(Exception):
    """The cached snapshot lacks what was asked for (a download may bring it)."""


def resolve(model: str, *, revision: str | None = None, download: bool = False,
            progress: bool | None = None) -> Path:
    """The local path of a Hub model: its snapshot folder (safetensors) or one .gguf file in it.

    `revision` (a config's key) pins a branch, tag or commit hash, as does ORG/NAME@REVISION
    (both at once must agree). Resolution reads only the cache. When the model is not
    there (or its snapshot lacks the files), `download=True` fetches it unless HF_HUB_OFFLINE
    is set; otherwise a ConfigError names the cache folder and the command that downloads it.
    progress: download bars on stderr (None: when stderr is a terminal).
    """
    hub_id = parse(model)
    if hub_id is None:
        raise ConfigError(f"model {model!r} is not a Hugging Face id (ORG/NAME[@REVISION][:FILE])")
    if revision is not None and hub_id.revision is not None and revision != hub_id.revision:
        raise ConfigError(f"model {model!r} pins revision {hub_id.revision!r} but `revision:` says {revision!r}; "
                          f"give one of them")
    hub_id = HubId(hub_id.repo, revision or hub_id.revision, hub_id.file)
    cache = hub_cache_dir()
    snapshot = _cached_snapshot(hub_id, cache)
    reason = f"no snapshot of revision {hub_id.revision or DEFAULT_REVISION!r} in {repo_folder(hub_id.repo, cache)}"
    if snapshot is not None:
        try:
            return _choose(snapshot, hub_id)
        except _NotUsable as exc:
            reason = str(exc)
    if download and not offline():
        snapshot = _download(hub_id, cache, progress)
        try:
            return _choose(snapshot, hub_id)
        except _NotUsable as exc:
            raise ModelLoadError(f"model {model!r}: downloaded, but {exc}") from None
    how = f"download it with:\n  {download_command(hub_id)}\n"
    if download:  # and offline
        how += "or unset HF_HUB_OFFLINE: `download: true` is set, but nothing is downloaded while HF_HUB_OFFLINE is"
    else:
        how += "or let hetero-sd download it: `download: true` in the config"
        if offline():
            how += " (and unset HF_HUB_OFFLINE, which is set: nothing is downloaded while it is)"
    raise ConfigError(f"model {model!r} is not in the Hugging Face cache {cache} ({reason}), nor a local path; {how}")


def _cached_snapshot(hub_id: HubId, cache: Path) -> Path | None:
    """The cached snapshot folder of the revision (refs/<branch or tag>, or a commit hash),
    through huggingface_hub without the network; a partial one too (_choose judges it)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        from huggingface_hub.errors import IncompleteSnapshotError
    except ImportError:  # older huggingface_hub: it does not check completeness
        IncompleteSnapshotError = LocalEntryNotFoundError

    try:
        return Path(snapshot_download(hub_id.repo, revision=hub_id.revision, cache_dir=cache,
                                      local_files_only=True))
    except IncompleteSnapshotError as exc:  # files of the tree listing missing: maybe not the ones we use
        path = getattr(exc, "snapshot_path", None)
        return Path(path) if path else None
    except LocalEntryNotFoundError:
        return None


def _ggufs(folder: Path) -> list[str]:
    """The .gguf files present in a snapshot, as repo paths (a/b.gguf), sorted."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.gguf") if p.is_file())


def _match(files: list[str], want: str) -> list[str]:
    """FILE of ORG/NAME:FILE among repo paths: the path, else the file name, else a quant
    tag (Q4_K_M) standing alone in the file name (not inside IQ4_K_M or Q4_K_M_L)."""
    for test in (lambda f: f == want, lambda f: f.rsplit("/", 1)[-1] == want):
        found = [f for f in files if test(f)]
        if found:
            return found
    tag = re.compile(rf"(?<![A-Z0-9_]){re.escape(want.upper())}(?![A-Z0-9_])")
    return [f for f in files if f.lower().endswith(".gguf") and tag.search(f.rsplit("/", 1)[-1].upper())]


def _safetensors_complete(folder: Path) -> str | None:
    """None when config.json and every weight file (per the shard index) are present, else what lacks."""
    if not (folder / "config.json").is_file():
        return "no config.json"
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as exc:
            return f"an unreadable {index.name} ({exc})"
        lacking = [s for s in shards if not (folder / s).is_file()]
        return f"shards missing: {', '.join(lacking)}" if lacking else None
    return None if any(p.is_file() for p in folder.glob("*.safetensors")) else "no *.safetensors"


def _choose(snapshot: Path, hub_id: HubId) -> Path:
    """What a snapshot resolves to. _NotUsable: the files are not (all) there; ConfigError: a
    choice to make (several .gguf files)."""
    ggufs = _ggufs(snapshot)
    if hub_id.file is not None:
        found = _match(ggufs, hub_id.file)
        if len(found) == 1:
            return snapshot / found[0]
        if len(found) > 1:
            raise ConfigError(f"model {str(hub_id)!r}: {hub_id.file!r} matches {len(found)} files in {snapshot}: "
                              f"{', '.join(found)}; name one as {hub_id.repo}:FILE")
        raise _NotUsable(f"{hub_id.file!r} is not among the .gguf files of {snapshot} "
                         f"({', '.join(ggufs) or 'none'})")
    lacking = _safetensors_complete(snapshot)
    if lacking is None:
        return snapshot
    if (snapshot / "config.json").is_file() and any(snapshot.glob("*.safetensors")):
        raise _NotUsable(f"the snapshot {snapshot} is incomplete: {lacking}")
    if len(ggufs) == 1:
        return snapshot / ggufs[0]
    if len(ggufs) > 1:
        raise _several(hub_id, ggufs)
    raise _NotUsable(f"the snapshot {snapshot} holds neither a safetensors model (config.json and *.safetensors) "
                     f"nor a .gguf file")


def _several(hub_id: HubId, ggufs: list[str]) -> ConfigError:
    return ConfigError(f"model {str(hub_id)!r}: the repo holds {len(ggufs)} .gguf files ({', '.join(ggufs)}); "
                       f"pick one as {hub_id.repo}:FILE (a file name, or a quant tag such as Q4_K_M)")


# ------------------------------------------------------------------ download (opt-in)
def wanted_files(repo_files: list[str], hub_id: HubId) -> list[str]:
    """The repo files to download for `hub_id`: the one .gguf FILE names; else a safetensors
    model's top-level files (config, weights, tokenizer, chat template; not .bin, .onnx or
    other quants); else the repo's single .gguf. A GGUF repo holds many quants: never all."""
    ggufs = [f for f in repo_files if f.lower().endswith(".gguf")]
    if hub_id.file is not None:
        found = _match(ggufs, hub_id.file)
        if len(found) != 1:
            what = "matches several" if found else "matches none"
            raise ConfigError(f"model {str(hub_id)!r}: {hub_id.file!r} {what} of the repo's .gguf files: "
                              f"{', '.join(found or ggufs) or 'none'}")
        return found
    top = [f for f in repo_files if "/" not in f]
    if "config.json" in top and any(f.endswith(".safetensors") for f in top):
        keep = (".json", ".safetensors", ".model", ".txt", ".jinja", ".tiktoken")
        return [f for f in top if f.endswith(keep) or f.startswith("tokenizer")]
    if len(ggufs) == 1:
        return ggufs
    if ggufs:
        raise _several(hub_id, ggufs)
    raise ConfigError(f"model {str(hub_id)!r}: the repo holds neither a safetensors model (config.json and "
                      f"*.safetensors at the top) nor a .gguf file")


def _download(hub_id: HubId, cache: Path, progress: bool | None) -> Path:
    """Fetch the files the model needs into the cache (huggingface_hub: resumable, shared
    with other tools), with its progress bars when `progress`."""
    import huggingface_hub
    from huggingface_hub.utils import (
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )

    show = sys.stderr.isatty() if progress is None else progress
    quiet = not show and not are_progress_bars_disabled()
    if quiet:
        disable_progress_bars()
    try:
        files = huggingface_hub.list_repo_files(hub_id.repo, revision=hub_id.revision)
        allow = wanted_files(files, hub_id)
        return Path(huggingface_hub.snapshot_download(hub_id.repo, revision=hub_id.revision, cache_dir=cache,
                                                      allow_patterns=allow))
    except ConfigError:
        raise
    except Exception as exc:  # not found, gated, no network, disk full: the Hub's own message says which
        raise ConfigError(f"model {str(hub_id)!r}: downloading from the Hugging Face Hub into {cache} failed: "
                          f"{type(exc).__name__}: {exc}") from exc
    finally:
        if quiet:
            enable_progress_bars()


# ------------------------------------------------------------------ listing
def _format(files: list[str]) -> str | None:
    has_st = "config.json" in files and any(f.endswith(".safetensors") and "/" not in f for f in files)
    has_gguf = any(f.lower().endswith(".gguf") for f in files)
    return "+".join(k for k, v in (("safetensors", has_st), ("gguf", has_gguf)) if v) or None


def cached_models(cache_dir: str | Path | None = None) -> list[dict]:
    """The model repos in the Hub cache that hold a safetensors model or .gguf files, for
    `hetero-sd models`: one dict per repo, sorted by id:
        id          ORG/NAME (what `model:` takes)
        path        the snapshot of the default branch (else the newest one)
        format      "safetensors", "gguf" or "safetensors+gguf" (of that snapshot)
        gguf        that snapshot's .gguf files (ORG/NAME:FILE picks one)
        size        bytes on disk, every revision
        revisions   [{commit, refs, path, format, size, gguf}], the default branch's first, then newest
    A missing cache folder lists nothing."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    cache = hub_cache_dir() if cache_dir is None else Path(cache_dir)
    try:
        info = scan_cache_dir(cache)
    except CacheNotFound:
        return []
    rows = []
    for repo in info.repos:
        if repo.repo_type != "model":
            continue
        revisions = []
        # the default branch's snapshot first, then the newest
        for rev in sorted(repo.revisions, key=lambda r: (DEFAULT_REVISION not in r.refs, -r.last_modified)):
            files = [f.file_path.relative_to(rev.snapshot_path).as_posix() for f in rev.files]
            revisions.append({"commit": rev.commit_hash, "refs": sorted(rev.refs), "path": str(rev.snapshot_path),
                              "format": _format(files), "size": rev.size_on_disk,
                              "gguf": sorted(f for f in files if f.lower().endswith(".gguf"))})
        usable = [r for r in revisions if r["format"]]
        if not usable:
            continue
        head = usable[0]
        rows.append({"id": repo.repo_id, "path": head["path"], "format": head["format"], "gguf": head["gguf"],
                     "size": repo.size_on_disk, "revisions": revisions})
    return sorted(rows, key=lambda r: r["id"].lower())


def models_table(rows: list[dict], cache_dir: str | Path | None = None):
    """`hetero-sd models`'s table of the cached Hub models (a rich Table)."""
    from rich.markup import escape
    from rich.table import Table

    cache = hub_cache_dir() if cache_dir is None else Path(cache_dir)
    table = Table(title=escape(f"Hugging Face cache ({cache}; `model: ORG/NAME[@REVISION][:FILE]`)"))
    table.add_column("id", no_wrap=True)
    for col in ("format", "size", "revisions", "path"):
        table.add_column(col)
    for row in rows:
        revs = ", ".join(",".join(r["refs"]) or r["commit"][:10] for r in row["revisions"])
        fmt = row["format"] + "".join(f"\n[dim]{escape(g)}[/dim]" for g in row["gguf"])
        table.add_row(escape(row["id"]), fmt, f"{row['size'] / 2**20:,.1f} MiB", escape(revs), escape(row["path"]))
    return table
