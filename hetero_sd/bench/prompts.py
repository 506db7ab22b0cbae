"""Benchmark prompts: JSONL, one {"id", "kind", "prompt"} object per line.

Every problem names the file and the line, so a hand-edited prompt set fails
at load with a message that says what to fix, not halfway through a run.
"""
from __future__ import annotations

import importlib.resources
import json
from dataclasses import dataclass
from pathlib import Path

from hetero_sd.errors import ConfigError

FIELDS = ("id", "kind", "prompt")
# Prompt sets shipped in the package, selected by name (`--prompts code`).
PROMPT_SETS = {"default": "prompts.jsonl", "code": "code-prompts.jsonl"}


def default_prompts_path() -> Path:
    return packaged_prompts("default")


def packaged_prompts(name: str) -> Path:
    return Path(str(importlib.resources.files("hetero_sd.bench") / PROMPT_SETS[name]))


def prompts_path(arg: str | Path | None) -> Path:
    """The file `--prompts` names: None is the default set, a set's name is that packaged set
    (unless a file of that name exists here: a path the user typed always wins), else a path."""
    if arg is None:
        return default_prompts_path()
    if str(arg) in PROMPT_SETS and not Path(arg).is_file():
        return packaged_prompts(str(arg))
    return Path(arg)


@dataclass(frozen=True)
class Prompt:
    id: str
    kind: str  # e.g. "grounded" (answer reuses the prompt's text) or "open"
    prompt: str


def _parse_line(path: Path, lineno: int, line: str) -> Prompt:
    where = f"{path}:{lineno}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno}); "
                          'each line must be one object {"id": ..., "kind": ..., "prompt": ...}') from None
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: expected a JSON object with keys {', '.join(FIELDS)}, "
                          f"got {type(obj).__name__}")
    missing = [k for k in FIELDS if k not in obj]
    if missing:
        raise ConfigError(f"{where}: missing key(s) {', '.join(missing)}; each line needs {', '.join(FIELDS)}")
    for key in FIELDS:
        if not isinstance(obj[key], str) or not obj[key].strip():
            raise ConfigError(f"{where}: {key!r} must be a non-empty string, got {obj[key]!r}")
    return Prompt(obj["id"], obj["kind"], obj["prompt"])


def load_prompts(path: str | Path | None = None, kinds: list[str] | None = None) -> list[Prompt]:
    """Read and check a prompts file (None or a set's name: a packaged set); keep only `kinds` if given."""
    path = prompts_path(path)
    if not path.is_file():
        raise ConfigError(f"prompts file {str(path)!r} does not exist")
    prompts: list[Prompt] = []
    seen: dict[str, int] = {}
    with open(path, encoding="utf-8") as stream:
        for lineno, line in enumerate(stream, 1):
            if not line.strip():
                continue  # blank lines (a trailing newline, spacing) are harmless
            p = _parse_line(path, lineno, line)
            if p.id in seen:
                raise ConfigError(f"{path}:{lineno}: duplicate id {p.id!r} (first on line {seen[p.id]})")
            seen[p.id] = lineno
            prompts.append(p)
    if not prompts:
        raise ConfigError(f"{path}: no prompts (expected one JSON object per line)")
    if kinds:
        present = sorted({p.kind for p in prompts})
        unknown = [k for k in kinds if k not in present]
        if unknown:
            raise ConfigError(f"--kinds: {', '.join(unknown)} not in {path}; kinds there: {', '.join(present)}")
        prompts = [p for p in prompts if p.kind in kinds]
    return prompts
