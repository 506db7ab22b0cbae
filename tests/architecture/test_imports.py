"""The import graph of the project's own modules has no cycle, function-level
imports included, and knows the package-dir mapping (hetero_sd.ir -> ir/).

Each module's imports are read from its source (every `import` and `from ...
import` anywhere in it), resolved against the project's modules, and the graph
is searched for strongly connected components. Importing a submodule runs its
parent package's __init__, but that is Python's mechanics, not a dependency
the code chose, so parent packages are not edges.
"""
from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def project_modules(root: Path) -> dict[str, Path]:
    """Module name -> source file, from pyproject's packages and package-dir."""
    setup = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir = setup.get("package-dir", {})
    modules = {}
    for package in setup["packages"]:
        folder = root / package_dir.get(package, package.replace(".", "/"))
        for file in sorted(folder.glob("*.py")):
            name = package if file.stem == "__init__" else f"{package}.{file.stem}"
            modules[name] = file
    return modules


def imports_of(name: str, file: Path, known: set[str]) -> set[str]:
    """The project modules `file` (module `name`) imports, wherever the import sits."""
    package = name if file.stem == "__init__" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = ".".join(parts[:len(parts) - node.level + 1])
                base = f"{anchor}.{base}" if base else anchor
            # `from a.b import c`: the module a.b.c if there is one, else a.b itself
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c.d` of a non-module attribute
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    modules = project_modules(root)
    return {name: imports_of(name, file, set(modules)) for name, file in modules.items()}


def test_the_project_has_no_import_cycle():
    graph = import_graph(ROOT)
    assert len(graph) > 60 and "hetero_sd.ir.model" in graph and "hetero_sd.backends.base" in graph
    assert "hetero_sd.engine" in graph["hetero_sd"]  # a function-level import is seen
    assert cycles(graph) == []


def test_layers_point_one_way():
    """hetero_sd -> scheduler -> ir <- backends: backends and the scheduler know
    nothing above them, the IR nothing but itself, drafters not the engine."""
    graph = import_graph(ROOT)
    rules = {"hetero_sd.backends.": ("hetero_sd.ir", "hetero_sd.backends"),
             "hetero_sd.scheduler.": ("hetero_sd.ir", "hetero_sd.scheduler"),
             "hetero_sd.ir.": ("hetero_sd.ir",)}
    for module, deps in graph.items():
        for prefix, allowed in rules.items():
            if module.startswith(prefix):
                bad = [d for d in deps if not d.startswith(allowed)]
                assert not bad, f"{module} imports {bad}"
        if module.startswith("hetero_sd.drafting"):
            assert not [d for d in deps if d in ("hetero_sd.engine", "hetero_sd.build", "hetero_sd.auto")], module


def test_the_checker_finds_a_cycle_through_a_function_level_import_and_a_mapped_dir(tmp_path):
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools]\npackage-dir = {"pkg" = "pkg", "pkg.low" = "low"}\npackages = ["pkg", "pkg.low"]\n')
    (tmp_path / "pkg").mkdir()
    (tmp_path / "low").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "top.py").write_text("from pkg.low import base\n")
    (tmp_path / "low" / "__init__.py").write_text("")
    (tmp_path / "low" / "base.py").write_text("def f():\n    from ..top import g\n")
    graph = import_graph(tmp_path)
    assert graph["pkg.top"] == {"pkg.low.base"} and graph["pkg.low.base"] == {"pkg.top"}
    assert cycles(graph) == [["pkg.low.base", "pkg.top"]]


DRAFTERS = {"NgramDrafter", "ModelDrafter", "CascadeDrafter", "RemoteDrafter", "HeadDrafter", "SuffixDrafter",
            "HybridDrafter"}


def test_drafters_are_constructed_in_one_function():
    """Outside tests, a drafter class is only ever called in drafting.build.build_drafter:
    the builder, placement: auto and the worker process all go through it."""
    calls = set()

    def visit(node, module: str, where: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            where = node.name
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) in DRAFTERS:
            calls.add((module, where))
        for child in ast.iter_child_nodes(node):
            visit(child, module, where)

    for name, file in project_modules(ROOT).items():
        visit(ast.parse(file.read_text(), str(file)), name, "<module>")
    assert calls == {("hetero_sd.drafting.build", "build_drafter")}, sorted(calls)
