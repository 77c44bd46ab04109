"""stargrpc's MCP endpoint driven by the MCP Inspector's CLI (from npm): the catalog the key
may see, a call with its text and run id, and a refused key."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tests.client_builds import npm_ci
from tests.mcp.conftest import McpUnderTest

INSPECTOR_DIR = Path(__file__).parent / "inspector"
TIMEOUT = 120


@pytest.fixture(scope="session")
def inspector() -> list[str]:
    """The Inspector's CLI, installed from the committed lock file when missing."""
    binary = INSPECTOR_DIR / "node_modules" / ".bin" / "mcp-inspector"
    npm_ci(INSPECTOR_DIR, binary)
    return [str(binary), "--cli"]


async def _inspect(inspector: list[str], server: McpUnderTest, key: str,
                   *args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *inspector, server.url, "--header", f"Authorization: Bearer {key}", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), TIMEOUT)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


def _json(output: str) -> dict:
    # The JSON answer is the output's one top-level object (warnings may come before it).
    return json.loads(output[output.index("{"):output.rindex("}") + 1])


async def test_the_inspector_lists_and_calls_tools_through_the_pipeline(
        mcp_server: McpUnderTest, inspector: list[str]) -> None:
    key = mcp_server.auth.key
    listed, called, refused = await asyncio.gather(
        _inspect(inspector, mcp_server, key, "--method", "tools/list"),
        _inspect(inspector, mcp_server, key, "--method", "tools/call", "--tool-name", "echo",
                 "--tool-arg", "text=hello inspector"),
        _inspect(inspector, mcp_server, "sgk_not_a_key", "--method", "tools/list"))

    assert listed[0] == 0, listed[1]
    names = {tool["name"] for tool in _json(listed[1])["tools"]}
    assert {"echo", "count"} <= names
    assert called[0] == 0, called[1]
    result = _json(called[1])
    assert result["content"] == [{"type": "text", "text": "hello inspector"}]
    assert result["isError"] is False and result["_meta"]["stargrpc.dev/outcome"] == "OK"
    assert refused[0] != 0  # an unknown key gets nothing
    assert "hello inspector" not in refused[1]
