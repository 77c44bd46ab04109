"""The MCP features are an extra (``stargrpc[mcp]``, issue 29): the Python SDK installs and
works beside an agent framework pinned to ``mcp < 2`` (langchain-mcp-adapters 0.3), and
asking for an MCP feature without the extra says what to install."""

from __future__ import annotations

import ast
import asyncio
import importlib.metadata
import os
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from stargrpc.cli import main
from stargrpc.errors import MissingExtra
from stargrpc.mcp import require_mcp
from stargrpc.server.grpc_server import StargrpcServer
from stargrpc.settings import Settings
from tests.conftest import ServerFactory

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "stargrpc"

#: Modules only the mcp extra brings (the SDK and what it alone requires).
EXTRA_MODULES = ("mcp", "mcp_types", "httpx2", "jsonschema", "referencing")


def _module_level_imports(path: Path) -> set[str]:
    """What ``path`` imports when it is imported (``if TYPE_CHECKING:`` blocks and
    function bodies excluded)."""
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.If):
                test = node.test
                if not (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"):
                    visit(node.body)
                    visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)

    visit(ast.parse(path.read_text()).body)
    return found


def test_nothing_outside_stargrpc_mcp_imports_the_mcp_sdk_at_module_level() -> None:
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        inside = path.parent == PACKAGE / "mcp"
        if inside and path.name != "__init__.py":
            continue
        bad = {name for name in _module_level_imports(path)
               if name.split(".")[0] in EXTRA_MODULES
               or (name.startswith("stargrpc.mcp.") and name not in (
                   "stargrpc.mcp.require_mcp", "stargrpc.mcp.require_mcp_for"))}
        if bad:
            offenders[str(path.relative_to(REPO))] = sorted(bad)
    assert not offenders, offenders


def test_each_mcp_feature_names_the_extra_when_it_is_missing(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    require_mcp("anything")  # installed here (the test extra)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "1.26.0")
    with pytest.raises(MissingExtra, match=r"mcp_servers needs stargrpc's MCP extra "
                       r"\(mcp>=2\.3\), and mcp 1\.26\.0 is installed: "
                       r"pip install 'stargrpc\[mcp\]'"):
        require_mcp("mcp_servers")
    for settings in ({"mcp_port": 0},
                     {"mcp_servers": [{"name": "up", "url": "http://127.0.0.1:9/mcp"}]}):
        with pytest.raises(MissingExtra, match=r"pip install 'stargrpc\[mcp\]'"):
            StargrpcServer(Settings.load(insecure_no_auth=True, state_dir=tmp_path,
                                         **settings))
    result = CliRunner().invoke(main, ["mcp-stdio", "--target", "127.0.0.1:9"])
    assert result.exit_code == 1
    assert "stargrpc mcp-stdio needs stargrpc's MCP extra" in result.output
    assert "pip install 'stargrpc[mcp]'" in result.output


SDK_CALL = textwrap.dedent('''
    import importlib.metadata, subprocess, sys
    from stargrpc.client import Client

    assert importlib.metadata.version("mcp").startswith("1."), importlib.metadata.version("mcp")
    with Client(sys.argv[1]) as client:
        result = client.call("echo", {"text": "beside mcp 1"})
    print("OUTPUT:" + result.output)
    assert "site-packages" in sys.modules["stargrpc"].__file__  # the installed copy
    # The command line works too, and says what an MCP feature needs.
    stdio = subprocess.run([sys.argv[2], "mcp-stdio", "--target", sys.argv[1]],
                           capture_output=True, text=True, timeout=60)
    print("STDIO:" + str(stdio.returncode) + ":" + stdio.stderr.replace("\\n", " "))
''')


@pytest.mark.timeout(900)  # a fresh venv and an install (from the pip cache): about a minute
async def test_the_sdk_installs_and_calls_beside_mcp_1(make_server: ServerFactory,
                                                       tmp_path: Path) -> None:
    # Runs wherever the suite runs, CI included: it is the promise an agent app relies on.
    server = await make_server()
    venv = tmp_path / "agent-app"
    await _run(tmp_path, sys.executable, "-m", "venv", str(venv))
    python, command = venv / "bin" / "python", venv / "bin" / "stargrpc"
    # No extra: what an agent app that also uses langchain-mcp-adapters 0.3 installs.
    await _run(tmp_path, str(python), "-m", "pip", "install", "-q", str(REPO), "mcp<2")
    out = await _run(tmp_path, str(python), "-c", SDK_CALL, f"127.0.0.1:{server.port}",
                     str(command))
    assert "OUTPUT:beside mcp 1" in out
    assert "STDIO:1:" in out and "pip install 'stargrpc[mcp]'" in out, out


async def _run(cwd: Path, *argv: str) -> str:
    """Runs ``argv`` in ``cwd`` (not the repository: there ``import stargrpc`` would find
    the source instead of what the venv installed)."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    process = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env,
        cwd=cwd)
    out, _ = await process.communicate()
    text = out.decode(errors="replace")
    assert process.returncode == 0, f"{argv[:4]} failed ({process.returncode}):\n{text[-4000:]}"
    return text
