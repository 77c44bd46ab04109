"""The supported API is what four modules export, and their ``__all__`` says exactly what.

As httpx's ``tests/test_exported_members.py``: a name defined in (or, for a package,
re-exported by) a public module is either in its ``__all__`` or underscore-private, and
every listed name resolves and is documented. The expected lists are spelled out here so
that a change to the public surface is a deliberate edit of this file.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "stargrpc"

PUBLIC: dict[str, set[str]] = {
    "stargrpc": {
        "ChildResult", "ChildRunError", "ChildRunRefused", "Outcome", "Principal",
        "StateError", "SyncToolContext", "SyncToolStep", "ToolContext",
        "ToolDenied", "ToolFailed", "ToolResult", "ToolStep", "__version__", "tool",
    },
    "stargrpc.client": {
        "NO_RETRY", "AsyncClient", "CallError", "Catalog", "Client", "ClientError", "Event",
        "FileChunk", "Heartbeat", "InjectedTool", "LaneQueued", "Notice", "Outcome", "Result",
        "ResumeError", "RetryPolicy", "RichMessage", "SentFile", "Step", "StepDelta",
        "StepEnded", "StepStarted", "ToolInfo", "ToolRunError", "Usage", "Violation",
        "event_from_proto", "open_channel",
    },
    "stargrpc.remote_registry": {
        "FALLBACK_METHOD", "IN_PROCESS_METHOD", "LOCAL_PRINCIPAL", "CollectedWriteBack", "Mode",
        "RemoteToolRegistry", "WriteBackTarget",
    },
    "stargrpc.contract": {"SERVICE_NAME", "Outcome", "reason_name"},
    "stargrpc.testing": {"TEST_PRINCIPAL", "RecordedRun", "ServedTools", "StepNode",
                         "load_tool_module", "record", "run_tool", "run_tool_sync", "serve",
                         "serve_tools"},
    "stargrpc.errors": {
        "ERROR_DOMAIN", "Aborted", "AuthConfigError", "CatalogStale", "CredentialsRejected",
        "CriticConfigError", "FailedPrecondition", "FieldViolation", "IdempotencyKeyReused",
        "Internal",
        "InvalidArgument", "KeysFileError", "MissingExtra", "NotFound", "OutOfRange",
        "PermissionDenied",
        "RequestError", "ResourceExhausted", "RunFinished", "StargrpcError",
        "ToolDefinitionError", "ToolDenied", "ToolFailed", "ToolOutcomeError",
        "Unauthenticated", "Unavailable", "WatcherTooSlow", "reason_name",
    },
}

# Packages whose submodules may be imported lazily; their own names must stay private.
LAZY_PACKAGES = {"stargrpc", "stargrpc.client"}


def _source(module: str) -> Path:
    relative = Path(*module.split(".")[1:])
    package = PACKAGE_DIR / relative / "__init__.py"
    return package if package.exists() else (PACKAGE_DIR / relative).with_suffix(".py")


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _offered_names(module: str) -> set[str]:
    """Names a reader of the module would take as offered: its top-level definitions and
    (for a package) what it re-exports from the project, including type-checking imports
    that its ``__getattr__`` serves."""
    tree = ast.parse(_source(module).read_text())
    names: set[str] = set()
    is_package = _source(module).name == "__init__.py"

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.ImportFrom) and is_package:
                if (node.module or "").startswith("stargrpc"):
                    names.update(alias.asname or alias.name for alias in node.names)
            elif isinstance(node, ast.If):
                if _is_type_checking(node) and is_package:
                    visit(node.body)
                elif not _is_type_checking(node):
                    visit(node.body)
                    visit(node.orelse)

    visit(tree.body)
    return {n for n in names if not n.startswith("_")}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_all_is_the_curated_list(module: str) -> None:
    exported = importlib.import_module(module).__all__
    assert len(exported) == len(set(exported)), f"{module}.__all__ repeats a name"
    assert set(exported) == PUBLIC[module]


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_every_offered_name_is_exported_or_private(module: str) -> None:
    exported = set(importlib.import_module(module).__all__)
    unlisted = _offered_names(module) - exported
    assert not unlisted, f"{module} offers {sorted(unlisted)} without listing them in __all__"


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_every_exported_name_resolves_and_is_documented(module: str) -> None:
    mod = importlib.import_module(module)
    for name in mod.__all__:
        value = getattr(mod, name)
        if inspect.isclass(value) or inspect.isfunction(value):
            assert inspect.getdoc(value), f"{module}.{name} has no docstring"
    assert set(mod.__all__) <= set(dir(mod))


@pytest.mark.parametrize("module", sorted(LAZY_PACKAGES))
def test_star_import_gives_exactly_the_public_names(module: str) -> None:
    namespace: dict[str, object] = {}
    exec(f"from {module} import *", namespace)
    assert set(namespace) - {"__builtins__"} == PUBLIC[module]


@pytest.mark.parametrize("module", sorted(LAZY_PACKAGES))
def test_an_unknown_name_is_an_attribute_error(module: str) -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        importlib.import_module(module).no_such_name  # noqa: B018 - the access is the test


# Modules that belong to the server; a client process never needs them.
SERVER_MODULES = (
    "stargrpc.settings", "stargrpc.registry", "stargrpc.runs", "stargrpc.server",
    "stargrpc.audit", "stargrpc.sandbox", "stargrpc.critic", "stargrpc.stores",
)


def _loaded_after(statement: str) -> set[str]:
    code = f"import sys\n{statement}\nprint('\\n'.join(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)
    return set(done.stdout.split())


def _server_modules(loaded: set[str]) -> list[str]:
    return sorted(m for m in loaded
                  if any(m == s or m.startswith(s + ".") for s in SERVER_MODULES))


def test_importing_the_client_loads_no_server_module() -> None:
    loaded = _loaded_after("import stargrpc.client")
    assert "stargrpc.client.aio" in loaded
    assert _server_modules(loaded) == []


def test_importing_the_top_level_loads_no_server_module_until_a_name_is_used() -> None:
    assert _server_modules(_loaded_after("import stargrpc")) == []
    assert "stargrpc.registry" in _loaded_after("from stargrpc import tool")


def test_the_remote_registry_is_still_reachable_from_the_client() -> None:
    from stargrpc.client import RemoteToolRegistry
    from stargrpc.remote_registry import RemoteToolRegistry as direct

    assert RemoteToolRegistry is direct


# The SDK's own modules, each imported alone in a fresh interpreter.
SDK_MODULES = sorted(
    "stargrpc.client" + ("" if path.stem == "__init__" else f".{path.stem}")
    for path in (PACKAGE_DIR / "client").glob("*.py"))


@pytest.mark.parametrize("module", SDK_MODULES)
def test_the_sdk_loads_only_itself_and_the_contract(module: str) -> None:
    loaded = {m for m in _loaded_after(f"import {module}") if m.startswith("stargrpc")}
    allowed = {"stargrpc", "stargrpc.contract"}
    outside = sorted(m for m in loaded if m not in allowed
                     and not m.startswith(("stargrpc.client", "stargrpc.v1")))
    assert module in loaded and not outside, f"{module} loads {outside}"
