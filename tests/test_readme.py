"""The README and the docs stay true: the configuration reference lists every setting as it
is, the contract reference says what the protos say, and the README's links lead somewhere."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_reference_is_current() -> None:
    reference = _script("settings_reference")

    page = (ROOT / "docs" / "operate" / "settings.md").read_text()

    assert reference.block() in page, (
        "docs/operate/settings.md's configuration reference is out of date: "
        "run `python scripts/settings_reference.py --write`")


def test_contract_reference_is_current() -> None:
    reference = _script("contract_reference")

    page = (ROOT / "docs" / "contract.md").read_text()

    assert page == reference.page(), (
        "docs/contract.md is out of date: run `python scripts/contract_reference.py --write`")


def test_contract_reference_carries_the_protos_comments() -> None:
    page = _script("contract_reference").page()

    assert "### service `ToolService`" in page
    assert "| `Execute` | [`ExecuteRequest`](#executerequest) | stream " in page
    assert "### enum `ErrorReason`" in page
    assert "| `after_seq` |" in page


def test_readme_commands_are_the_ones_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()

    assert "bash scripts/test.sh" in readme and "bash scripts/test.sh" in ci
    assert ".venv/bin/stargrpc serve" in readme


def test_readme_links_lead_to_files() -> None:
    readme = (ROOT / "README.md").read_text()

    targets = [t for t in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
               if "://" not in t]

    assert targets
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, f"README.md links to missing files: {missing}"
