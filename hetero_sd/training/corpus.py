"""Teacher-forced text found on this machine, for a head's training data (nothing is downloaded).

Four sources, mixed in equal shares of the character budget so none crowds
out the others:
  reference  Python's own reference manual (pydoc_data.topics, shipped with CPython)
  readmes    the long descriptions of the installed PyPI packages (their METADATA files)
  docstrings module, class and function docstrings of the standard library and the
             installed packages, 200-2,000 characters
  code       standard-library source files
Each text becomes an assistant turn after a short user request (`as_chat`),
so the target's states are those of answering, which is what the head drafts.
"""
from __future__ import annotations

import ast
import random
import site
import sysconfig
from email.parser import HeaderParser
from pathlib import Path
from typing import Callable, Iterator

SOURCES = ("reference", "readmes", "docstrings", "code")


def _stdlib() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_modules() -> list[Path]:
    """The standard library's top-level modules of some length, sorted."""
    return sorted(p for p in _stdlib().glob("*.py") if p.stat().st_size > 2000)


def docstrings_of(path: Path) -> Iterator[tuple[str, str]]:
    """(name, docstring) of a Python file's module, classes and functions."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except (SyntaxError, ValueError):
        return
    for node in [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))]:
        doc = ast.get_docstring(node)
        if doc:
            yield getattr(node, "name", path.stem), doc


def _site() -> list[Path]:
    return [Path(p) for p in site.getsitepackages() if Path(p).is_dir()]


def _reference(rng: random.Random) -> Iterator[tuple[str, str]]:
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return
    names = sorted(topics)
    rng.shuffle(names)
    for name in names:
        yield f"Explain the Python topic '{name}'.", topics[name].strip()


def _readmes(rng: random.Random) -> Iterator[tuple[str, str]]:
    metas = sorted(p for root in _site() for p in root.glob("*.dist-info/METADATA"))
    rng.shuffle(metas)
    for path in metas:
        msg = HeaderParser().parsestr(path.read_text(encoding="utf-8", errors="replace"))
        body = (msg.get_payload() or "").strip()
        if len(body) > 400:
            yield f"Write the README of the Python package {msg.get('Name', path.parent.name)}.", body


def _docstrings(rng: random.Random) -> Iterator[tuple[str, str]]:
    files = sorted(_stdlib().glob("*.py")) + sorted(p for root in _site() for p in root.glob("*/*.py"))
    rng.shuffle(files)
    for path in files:
        for what, doc in docstrings_of(path):
            if 200 <= len(doc) <= 2000:
                yield f"Document `{what}` from {path.stem}.", doc


def _code(rng: random.Random) -> Iterator[tuple[str, str]]:
    files = stdlib_modules()
    rng.shuffle(files)
    for path in files:
        yield f"Write the Python module {path.stem}.py.", path.read_text(encoding="utf-8", errors="replace")


def teacher_texts(chars: int, seed: int = 0, sources: tuple[str, ...] = SOURCES) -> list[tuple[str, str, str]]:
    """(source, request, text) triples, up to `chars` characters in all, each source its share."""
    makers = {"reference": _reference, "readmes": _readmes, "docstrings": _docstrings, "code": _code}
    out = []
    for name in sources:
        budget = chars // len(sources)
        for request, text in makers[name](random.Random(seed)):
            if budget <= 0:
                break
            text = text[:budget]
            out.append((name, request, text))
            budget -= len(text)
    return out


def as_chat(encode_request: Callable[[str], list[int]], encode_text: Callable[[str], list[int]],
            request: str, text: str, length: int) -> list[list[int]]:
    """The text as answers to the request, cut into sequences of at most `length` tokens
    (each one the request's tokens, then a piece of the text)."""
    head, body = encode_request(request), encode_text(text)
    step = max(16, length - len(head))
    return [head + body[i:i + step] for i in range(0, len(body), step) if len(body[i:i + step]) >= 16]
