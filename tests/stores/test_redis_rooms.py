"""The rooms of :mod:`stargrpc.stores.redis` talk through methods: no module of the package
reads or writes another object's underscore attributes (``self._x`` is its own), nor imports
another module's private names. Read from the source (ast), as tests/test_import_graph.py
reads imports."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "stargrpc" / "stores" / "redis"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _reaches(source: str, filename: str = "<source>") -> list[str]:
    """Where ``source`` reaches into what is not its own: ``other._x`` (anything but a bare
    ``self`` or ``cls`` before the dot) and ``from … import _x``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            owner = node.value
            if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.ImportFrom):
            found.extend((node.lineno, f"from {node.module} import {alias.name}")
                         for alias in node.names if _private(alias.name))
    return [f"{filename}:{line}: {what}" for line, what in sorted(found)]


def test_the_check_finds_a_room_reaching_into_another() -> None:
    assert _reaches("store._wants_flush(self)\nself._ok = run_log._pending") == [
        "<source>:1: store._wants_flush", "<source>:2: run_log._pending"]
    assert _reaches("self._store._key(run_id)") == ["<source>:1: self._store._key"]
    assert _reaches("from stargrpc.stores.redis.errors import _reachable") == [
        "<source>:1: from stargrpc.stores.redis.errors import _reachable"]
    assert _reaches("self._pending.clear()\ncls._made = True\nx.__class__") == []


def test_no_room_of_the_redis_store_reaches_into_another() -> None:
    modules = sorted(PACKAGE_DIR.glob("*.py"))
    assert len(modules) > 5
    found = [line for path in modules
             for line in _reaches(path.read_text(), path.name)]
    assert not found, "reaching into another's privates:\n" + "\n".join(found)
