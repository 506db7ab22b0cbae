"""On-disk cache of what is derived from a model (lowered graphs, compiled
blobs, a tokenizer built from a GGUF), keyed by what it depends on: the model
files' identity (path, size, mtime) and the builder's and runtime's versions.
A stale key simply misses. Root: $HETERO_SD_CACHE, else ~/.cache/hetero-sd; a
worker process uses its engine's (`use_root`)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable


_ROOT: Path | None = None  # a worker's engine's root (use_root); None: as the environment says


def configured_root() -> str | None:
    """The root $HETERO_SD_CACHE names (None: the default): what a worker is given."""
    return os.environ.get("HETERO_SD_CACHE") or None


def use_root(root: str | None) -> None:
    """Make `root` (None: the default folder) this process's cache root: a worker
    process's, given by its engine rather than through its environment."""
    global _ROOT
    _ROOT = Path(root or _default_root())


def _default_root() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "hetero-sd")


def cache_root() -> Path:
    if _ROOT is not None:
        return _ROOT
    return Path(configured_root() or _default_root())


def model_identity(model: str | Path) -> dict:
    """Identity of the weights on disk at a model path (a ModelIR's `source`): every
    file they come from, with size and mtime."""
    src = Path(model)
    files = [src] if src.is_file() else sorted(p for p in src.iterdir() if p.suffix in (".safetensors", ".json"))
    return {str(p.resolve()): [p.stat().st_size, p.stat().st_mtime_ns] for p in files}


def cache_dir(kind: str, model: str | Path, **parts) -> Path:
    """The folder for `kind` derived from `model` (a model path: a ModelIR's `source`)."""
    key = json.dumps({"model": model_identity(model), **parts}, sort_keys=True, default=str)
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return cache_root() / kind / f"{Path(model).stem}-{digest}"


def cached(folder: Path, filename: str, build: Callable[[Path], None]) -> Path:
    """Return folder/filename, building it atomically (into a temp folder, then rename) if absent."""
    target = folder / filename
    if target.exists():
        return target
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".building-"))
    try:
        build(tmp / filename)
        try:
            os.rename(tmp, folder)
        except OSError:  # another process finished first: use theirs
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
