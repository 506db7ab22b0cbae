"""The documentation's commands and links: every `hetero-sd ...` command in a
fenced shell block of README.md and docs/*.md parses with the real CLI parser,
every docs/ page is linked from the README, and every relative link between
pages (and to files in the repository) points at something that exists."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from hetero_sd.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
OPERATORS = {"&&", "||", "|", ";", "&"}
REDIRECTS = {">", ">>", "<", ">&", "&>", "<<"}
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def fenced_blocks(text: str):
    """(language, first line number, lines) for every fenced code block."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(2), m.group(3).lower(), i + 1
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append((i + 1, lines[i]))
            i += 1
        yield lang, start, body
        i += 1


def logical_lines(body):
    """Join lines ending with a backslash; strip a `$ ` prompt. Yields (line number, text)."""
    pending, first = "", None
    for number, line in body:
        if first is None:
            first = number
        stripped = line.rstrip()
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        text = (pending + stripped).strip()
        pending, start, first = "", first, None
        if text.startswith("$ "):
            text = text[2:]
        if text:
            yield start, text
    if pending.strip():
        yield first, pending.strip()


def commands_in(text: str):
    """argv lists (after `hetero-sd`) of every hetero-sd command in a shell line:
    alone, after `$ `, after env assignments, inside `&&` / `|` / `;` chains;
    trailing `# comments` dropped."""
    lex = shlex.shlex(text, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    lex.commenters = "#"
    tokens = list(lex)
    segment: list[str] = []
    redirected = False  # after `> file`: the rest of the segment is not the command's
    for token in [*tokens, ";"]:
        if token in OPERATORS:
            words = segment
            while words and ENV_ASSIGNMENT.match(words[0]):
                words = words[1:]
            if words and words[0] == "hetero-sd":
                yield words[1:]
            segment, redirected = [], False
        elif token in REDIRECTS:
            redirected = True
        elif not redirected:
            segment.append(token)


def collect_commands():
    found = []
    for page in PAGES:
        for lang, _, body in fenced_blocks(page.read_text(encoding="utf-8")):
            if lang not in SHELL_LANGS:
                continue
            for number, text in logical_lines(body):
                if "hetero-sd" not in text:
                    continue
                for argv in commands_in(text):
                    found.append((rel(page), number, text, argv))
    return found


COMMANDS = collect_commands()


def test_the_collector_reads_shell_lines():
    block = [(1, "$ hetero-sd devices --json"),
             (2, "pip install -e . && hetero-sd generate --prompt \"a # b\"   # a comment"),
             (3, "echo hi | hetero-sd generate --json > out.json"),
             (4, "hetero-sd bench --peers none \\"),
             (5, "    --config my.yaml"),
             (6, "HETERO_SD_BACKENDS=x=y:Z hetero-sd devices; ray stop")]
    found = [(n, argv) for n, text in logical_lines(block) for argv in commands_in(text)]
    assert found == [(1, ["devices", "--json"]), (2, ["generate", "--prompt", "a # b"]),
                     (3, ["generate", "--json"]), (4, ["bench", "--peers", "none", "--config", "my.yaml"]),
                     (6, ["devices"])]
    with pytest.raises(SystemExit):  # what a wrong flag does, so the check below can catch it
        build_parser().parse_args(["generate", "--no-such-flag"])


def test_a_healthy_number_of_commands_is_found():
    """A broken collector must not pass by finding nothing."""
    assert len(COMMANDS) >= 20, f"only {len(COMMANDS)} hetero-sd commands found in the docs"
    subcommands = {argv[0] for _, _, _, argv in COMMANDS if argv}
    assert {"generate", "devices", "models", "profile", "bench", "serve", "train-head"} <= subcommands, subcommands


@pytest.mark.parametrize("page, line, text, argv", COMMANDS,
                         ids=[f"{page}:{line}" for page, line, _, _ in COMMANDS])
def test_documented_command_parses(page, line, text, argv, capsys):
    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:
        if exc.code in (0, None):  # --help, --version: argparse exits 0
            return
        err = capsys.readouterr().err.strip()
        pytest.fail(f"{page}:{line}: `{text}` does not parse (exit {exc.code}): {err}")


# ------------------------------------------------------------------ links

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def prose(text: str) -> str:
    """The text with fenced code blocks blanked (links inside code are not links)."""
    lines = text.splitlines()
    for _, start, body in fenced_blocks(text):
        for number, _ in body:
            lines[number - 1] = ""
        lines[start - 1] = ""
    return "\n".join(lines)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose(path.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links():
    for page in PAGES:
        for number, line in enumerate(prose(page.read_text(encoding="utf-8")).splitlines(), 1):
            for m in LINK.finditer(line):
                target = m.group(1)
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                    continue
                yield page, number, target


LINKS = list(links())


def test_every_docs_page_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    linked = {(ROOT / t.split("#")[0]).resolve() for p, _, t in LINKS if p.name == "README.md" and p.parent == ROOT}
    pages = sorted(DOCS.glob("*.md"))
    assert pages, "no docs/ pages"
    missing = [rel(p) for p in pages if p.resolve() not in linked]
    assert not missing, f"docs pages not linked from README.md: {missing}"
    assert "python -m pytest -q" in readme


def test_relative_links_resolve():
    assert len(LINKS) >= 20, f"only {len(LINKS)} links found: the link collector is broken"
    broken = []
    for page, number, target in LINKS:
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page.resolve()
        if not dest.exists():
            broken.append(f"{rel(page)}:{number}: {target} (no such file)")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{rel(page)}:{number}: {target} (no heading #{anchor} in {rel(dest)})")
    assert not broken, "broken links:\n" + "\n".join(broken)
