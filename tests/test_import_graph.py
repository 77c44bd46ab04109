"""No import loops among the project's modules: the way of an Execute flows one way.

The graph is read from the source (ast), not from an interpreter's import state, so a loop
shows whichever module a test happens to import first. A module depends on another when it
imports it, a name from it, or a module inside it (which loads the package first). The
packages a module lives in are not edges: Python loads them before the module anyway.

Three graphs, each of which must be free of loops:

- ``module``: imports at module level, ``if TYPE_CHECKING:`` blocks excluded — what runs
  when a module is imported;
- ``deferred``: plus imports inside functions — a loop hidden in a function is still a loop;
- ``typing``: plus ``if TYPE_CHECKING:`` blocks — types flow the same way as code.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "stargrpc"

KINDS = ("module", "deferred", "typing")


def _modules(package_dir: Path) -> dict[str, Path]:
    found = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported(name: str, path: Path, modules: dict[str, Path], kind: str) -> set[str]:
    """The project's modules ``name`` imports, as ``kind`` counts them."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()

    def absolute(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = package.split(".")[: len(package.split(".")) - node.level + 1]
        return ".".join([*base, *([node.module] if node.module else [])])

    def visit(body: Iterable[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                source = absolute(node)
                submodules = {f"{source}.{a.name}" for a in node.names} & modules.keys()
                targets.update(submodules)
                if len(submodules) < len(node.names):
                    targets.add(source)
            elif isinstance(node, ast.If) and _is_type_checking(node):
                if kind == "typing":
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if kind != "module":
                    visit(node.body)
            else:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    visit(getattr(node, field, None) or [])
                for case in getattr(node, "cases", None) or []:
                    visit(case.body)

    visit(ast.parse(path.read_text(), str(path)).body)
    edges: set[str] = set()
    for target in targets:
        parts = target.split(".")
        for end in range(1, len(parts) + 1):
            module = ".".join(parts[:end])
            is_own_package = name == module or name.startswith(module + ".")
            if module in modules and not is_own_package:
                edges.add(module)
    return edges


def import_graph(package_dir: Path, kind: str) -> dict[str, set[str]]:
    """Each module of the package and the package's modules it imports."""
    modules = _modules(package_dir)
    return {name: _imported(name, path, modules, kind) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One loop through each strongly connected group of modules (Tarjan), shortest first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return sorted((_loop_in(graph, group) for group in groups), key=len)


def _loop_in(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node] & group):
                if target == start:
                    return [*paths[node], start]
                if target not in paths:
                    paths[target] = [*paths[node], target]
                    following.append(target)
        frontier = following
    raise AssertionError(f"no loop through {start} in {sorted(group)}")


@pytest.mark.parametrize("kind", KINDS)
def test_the_package_has_no_import_loops(kind: str) -> None:
    found = cycles(import_graph(PACKAGE_DIR, kind))
    assert not found, "import loops:\n" + "\n".join(" -> ".join(loop) for loop in found)


def test_the_graph_covers_the_package() -> None:
    graph = import_graph(PACKAGE_DIR, "module")
    assert {"stargrpc.client.events", "stargrpc.audit.store", "stargrpc.runs.run"} <= graph.keys()
    assert "stargrpc.runs.context" in graph["stargrpc.runs.run"]
    assert "stargrpc.audit.sql" in graph["stargrpc.audit.sqlite"]


def _write(root: Path, files: dict[str, str]) -> Path:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_each_kind_of_loop_is_found(tmp_path: Path) -> None:
    package = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg.b import B\n",
        "pkg/b.py": "def f():\n    from pkg import a\nB = 1\n",
        "pkg/c.py": ("from typing import TYPE_CHECKING\n"
                     "if TYPE_CHECKING:\n    from pkg.d import D\n"),
        "pkg/d.py": "from . import c\nD = 1\n",
        "pkg/sub/__init__.py": "from pkg.e import E\n",
        "pkg/sub/x.py": "X = 1\n",
        "pkg/e.py": "import pkg.sub.x\nE = 1\n",
    })
    module = cycles(import_graph(package, "module"))
    assert module == [["pkg.e", "pkg.sub", "pkg.e"]]
    deferred = cycles(import_graph(package, "deferred"))
    assert ["pkg.a", "pkg.b", "pkg.a"] in deferred
    assert ["pkg.c", "pkg.d", "pkg.c"] not in deferred
    assert ["pkg.c", "pkg.d", "pkg.c"] in cycles(import_graph(package, "typing"))


def test_a_module_inside_a_package_may_import_its_package(tmp_path: Path) -> None:
    package = _write(tmp_path, {
        "pkg/__init__.py": "from pkg.a import A\n",
        "pkg/a.py": "import pkg\nfrom pkg import b\nA = 1\n",
        "pkg/b.py": "B = 1\n",
    })
    assert cycles(import_graph(package, "typing")) == []
