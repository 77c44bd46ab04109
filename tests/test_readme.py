"""The README stays true: its configuration reference lists every setting as it is."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _reference_module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(
        "settings_reference", ROOT / "scripts" / "settings_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_reference_is_current() -> None:
    reference = _reference_module()

    readme = (ROOT / "README.md").read_text()

    assert reference.block() in readme, (
        "README.md's configuration reference is out of date: "
        "run `python scripts/settings_reference.py --write`")


def test_readme_commands_are_the_ones_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()

    assert "bash scripts/test.sh" in readme and "bash scripts/test.sh" in ci
    assert ".venv/bin/stargrpc serve" in readme
