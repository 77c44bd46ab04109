"""The MCP features are an extra (``stargrpc[mcp]``, issue 29): the Python SDK installs and
works beside an agent framework pinned to ``mcp < 2`` (langchain-mcp-adapters 0.3, whose
own MCP client is tested here against the endpoint: it cannot share the suite's venv), and
asking for an MCP feature without the extra says what to install."""

from __future__ import annotations

import ast
import asyncio
import importlib.metadata
import json
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner
from packaging.requirements import Requirement

from stargrpc.cli import main
from stargrpc.errors import MissingExtra
from stargrpc.mcp import MCP_REQUIREMENT, require_mcp
from stargrpc.server.grpc_server import StargrpcServer
from stargrpc.settings import Settings
from tests.mcp.conftest import McpUnderTest
from tests.mcp.venvs import run_command

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "stargrpc"

#: The langchain-mcp-adapters an agent app installs beside the SDK (it needs mcp < 2).
LANGCHAIN_MCP_ADAPTERS = "0.3.2"

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


def _pyproject_mcp_extra() -> list[str]:
    return list(tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["mcp"])


def test_the_requirement_named_is_the_mcp_extra_s() -> None:
    # Said twice (the code names it when the SDK is missing): the two must agree.
    assert Requirement(MCP_REQUIREMENT) in [Requirement(line) for line in _pyproject_mcp_extra()]
    assert importlib.metadata.requires("stargrpc") is not None


SDK_CALL = textwrap.dedent('''
    import importlib.metadata, subprocess, sys
    from stargrpc.client import Client

    assert importlib.metadata.version("mcp").startswith("1."), importlib.metadata.version("mcp")
    with Client(sys.argv[1], api_key=sys.argv[3]) as client:
        result = client.call("echo", {"text": "beside mcp 1"})
    print("OUTPUT:" + result.output)
    assert "site-packages" in sys.modules["stargrpc"].__file__  # the installed copy
    # The command line works too, and says what an MCP feature needs.
    stdio = subprocess.run([sys.argv[2], "mcp-stdio", "--target", sys.argv[1]],
                           capture_output=True, text=True, timeout=60)
    print("STDIO:" + str(stdio.returncode) + ":" + stdio.stderr.replace("\\n", " "))
''')

#: langchain-mcp-adapters (with its mcp 1) against the MCP endpoint: the tools as LangChain
#: tools, a call with progress, a tool error, a call cancelled mid-run, wrong credentials.
LANGCHAIN_CALLS = textwrap.dedent('''
    import asyncio, json, sys
    from langchain_mcp_adapters.callbacks import Callbacks
    from langchain_mcp_adapters.client import MultiServerMCPClient

    url, key, gate = sys.argv[1], sys.argv[2], sys.argv[3]
    progress, waiting = [], asyncio.Event()

    async def on_progress(value, total, message, context):
        progress.append(message)
        if message and "waiting at the gate" in message:
            waiting.set()

    def server(token):
        return {"stargrpc": {"transport": "streamable_http", "url": url,
                             "headers": {"Authorization": "Bearer " + token}}}

    async def main():
        client = MultiServerMCPClient(server(key), callbacks=Callbacks(on_progress=on_progress))
        tools = {tool.name: tool for tool in await client.get_tools()}
        out = {"tools": sorted(tools), "count": await tools["count"].ainvoke({"to": 3})}
        try:
            out["breaks"] = await tools["breaks"].ainvoke({})
        except Exception as error:
            out["breaks"] = "raised " + str(error)
        call = asyncio.ensure_future(tools["wait_at_gate"].ainvoke({"gate": gate}))
        await asyncio.wait_for(waiting.wait(), 30)
        call.cancel()
        try:
            await call
            out["cancelled"] = "not cancelled"
        except asyncio.CancelledError:
            out["cancelled"] = "cancelled"
        out["progress"] = progress
        try:
            await MultiServerMCPClient(server("not-a-key")).get_tools()
            out["bad_key"] = "accepted"
        except BaseException as error:
            out["bad_key"] = repr(error)
        print("LANGCHAIN:" + json.dumps(out, default=str))

    asyncio.run(main())
''')


@pytest.mark.timeout(900)  # a fresh venv and an install (from the pip cache): about a minute
async def test_the_sdk_and_langchain_mcp_adapters_beside_mcp_1(
        eager_mcp_server: McpUnderTest, gate: tuple[str, asyncio.Event, asyncio.Event],
        tmp_path: Path) -> None:
    mcp_server = eager_mcp_server  # every step of the short count (progress threshold 0)
    # Runs wherever the suite runs, CI included: it is the promise an agent app relies on.
    name, _, cancelled = gate
    venv = tmp_path / "agent-app"
    await run_command(tmp_path, sys.executable, "-m", "venv", str(venv))
    python, command = venv / "bin" / "python", venv / "bin" / "stargrpc"
    # No extra: what an agent app that also uses langchain-mcp-adapters 0.3 installs.
    # (--no-compile: the modules the app imports compile as they are imported.)
    await run_command(tmp_path, str(python), "-m", "pip", "install", "-q", "--no-compile",
                      str(REPO), "mcp<2", f"langchain-mcp-adapters=={LANGCHAIN_MCP_ADAPTERS}")
    out = await run_command(tmp_path, str(python), "-c", SDK_CALL, mcp_server.auth.target,
                            str(command), mcp_server.auth.key)
    assert "OUTPUT:beside mcp 1" in out
    assert "STDIO:1:" in out and "pip install 'stargrpc[mcp]'" in out, out
    # The same app's LangChain agent reaches the same server's MCP endpoint.
    out = await run_command(tmp_path, str(python), "-c", LANGCHAIN_CALLS, mcp_server.url,
                            mcp_server.auth.key, name)
    seen = json.loads(out.split("LANGCHAIN:", 1)[1])
    assert {"echo", "count", "wait_at_gate"} <= set(seen["tools"])
    assert "counted to 3" in json.dumps(seen["count"])
    assert "ERROR [TOOL_EXCEPTION]" in json.dumps(seen["breaks"])
    assert "Counting to 3: 2" in seen["progress"]
    assert seen["cancelled"] == "cancelled"
    await asyncio.wait_for(cancelled.wait(), 10)  # the run stopped with the call
    assert "401" in seen["bad_key"] or "nauthorized" in seen["bad_key"], seen["bad_key"]
