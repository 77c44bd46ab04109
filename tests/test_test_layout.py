"""The test modules share code only through helpers modules and conftest.py: no module of
tests/ imports from a ``test_*`` module, imports a name private (``_name``) to another module
of tests/, or imports a fixture from anywhere but a conftest.py (where fixtures live; a
conftest.py of one folder may take another's, as pytest shares fixtures across folders).

Read from the source (ast), every import counted, at module level or inside a function, so a
test module can be moved, renamed or run alone without breaking another.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent


def _modules(root: Path) -> dict[str, Path]:
    """Each module under ``root`` (a package) by its dotted name."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_fixture(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return (isinstance(target, ast.Attribute) and target.attr == "fixture") or (
        isinstance(target, ast.Name) and target.id == "fixture")


def _fixtures(path: Path) -> set[str]:
    """The names of the fixtures a module defines."""
    return {node.name for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and any(_is_fixture(decorator) for decorator in node.decorator_list)}


def _is_test_module(name: str) -> bool:
    return name.rpartition(".")[2].startswith("test_")


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def offences(root: Path) -> list[str]:
    """Each import under package ``root`` from a test module, of another module's private
    name, or of a fixture not from a conftest.py: ``path:line: what``."""
    modules = _modules(root)
    fixtures: dict[str, set[str]] = {}
    found = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        where = f"{path.relative_to(root.parent)}"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.extend(f"{where}:{node.lineno}: imports test module {alias.name}"
                             for alias in node.names
                             if alias.name in modules and _is_test_module(alias.name))
                continue
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            if source not in modules:
                continue
            if _is_test_module(source):
                found.append(f"{where}:{node.lineno}: imports from test module {source}")
                continue
            for alias in node.names:
                if f"{source}.{alias.name}" in modules:
                    if _is_test_module(alias.name):
                        found.append(f"{where}:{node.lineno}: imports test module "
                                     f"{source}.{alias.name}")
                elif _is_private(alias.name):
                    found.append(f"{where}:{node.lineno}: imports private {alias.name} "
                                 f"from {source}")
                elif source.rpartition(".")[2] != "conftest":
                    if source not in fixtures:
                        fixtures[source] = _fixtures(modules[source])
                    if alias.name in fixtures[source]:
                        found.append(f"{where}:{node.lineno}: imports fixture {alias.name} "
                                     f"from {source} (fixtures live in conftest.py)")
    return found


def test_test_modules_share_code_only_through_helpers_and_conftest() -> None:
    found = offences(TESTS_DIR)
    assert not found, ("move what is shared to a helpers module or conftest.py:\n"
                       + "\n".join(found))


def test_the_check_covers_the_tests() -> None:
    modules = _modules(TESTS_DIR)
    assert {"tests.conftest", "tests.helpers", "tests.stores.helpers", "tests.stores.conftest",
            "tests.test_test_layout"} <= modules.keys()
    assert "go_cli" in _fixtures(modules["tests.conftest"])


def test_each_kind_of_offence_is_found(tmp_path: Path) -> None:
    files = {
        "pkg/__init__.py": "",
        "pkg/conftest.py": "import pytest\n@pytest.fixture\ndef made(): ...\nPUBLIC = 1\n",
        "pkg/helpers.py": ("import pytest\ndef shared(): ...\ndef _own(): ...\n"
                           "@pytest.fixture\ndef stray(): ...\n__all__ = ['shared']\n"),
        "pkg/sub/__init__.py": "",
        "pkg/sub/test_a.py": "def helper(): ...\n",
        "pkg/sub/test_b.py": ("from pkg.sub.test_a import helper\n"
                              "from .test_a import helper as again\n"
                              "from pkg.sub import test_a\n"
                              "import pkg.sub.test_a\n"
                              "from pkg.helpers import _own, shared, __all__\n"
                              "from pkg.conftest import PUBLIC, made\n"
                              "from pkg.helpers import stray\n"
                              "import pytest\n"
                              "def test_it():\n    from ..helpers import _own\n"),
        "pkg/sub/conftest.py": "from pkg.conftest import made\n",
        "pkg/sub/test_c.py": "from pkg.helpers import shared\nfrom pkg.conftest import PUBLIC\n",
    }
    for relative, text in files.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    assert sorted(offences(tmp_path / "pkg")) == sorted([
        "pkg/sub/test_b.py:1: imports from test module pkg.sub.test_a",
        "pkg/sub/test_b.py:2: imports from test module pkg.sub.test_a",
        "pkg/sub/test_b.py:3: imports test module pkg.sub.test_a",
        "pkg/sub/test_b.py:4: imports test module pkg.sub.test_a",
        "pkg/sub/test_b.py:5: imports private _own from pkg.helpers",
        "pkg/sub/test_b.py:7: imports fixture stray from pkg.helpers (fixtures live in "
        "conftest.py)",
        "pkg/sub/test_b.py:10: imports private _own from pkg.helpers",
    ])
