"""The module map of docs/internals/development.md names every module and package of
``stargrpc``, so a newcomer listing the package finds each one explained there."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "stargrpc"


def test_every_module_of_the_package_is_on_the_map() -> None:
    page = (ROOT / "docs" / "internals" / "development.md").read_text()
    entries = [p.name + "/" if p.is_dir() else p.name for p in PACKAGE.iterdir()
               if not p.name.startswith("_") and p.name != "py.typed"
               and (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))]
    missing = [name for name in sorted(entries) if f"  {name}" not in page]
    assert entries and not missing, f"not on the module map: {missing}"


def test_every_module_of_the_run_core_and_the_grpc_face_is_on_the_map() -> None:
    page = (ROOT / "docs" / "internals" / "development.md").read_text()
    for folder in ("runs", "server"):
        entries = [p.name + "/" if p.is_dir() else p.name for p in (PACKAGE / folder).iterdir()
                   if not p.name.startswith("_")
                   and (p.suffix == ".py" or (p / "__init__.py").exists())]
        missing = [name for name in sorted(entries) if f"    {name}" not in page]
        assert entries and not missing, f"not on the module map of {folder}/: {missing}"
