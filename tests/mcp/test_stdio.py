"""``stargrpc mcp-stdio``: the same bridge over stdio, launched as a command the way a
desktop MCP client launches it, against a real server."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

import mcp_types as types
import pytest
from mcp import Client, StdioServerParameters
from mcp.shared.exceptions import MCPError

from stargrpc.mcp.mapping import MAX_TEXT_CHARS, UNAUTHENTICATED
from tests.mcp.conftest import McpUnderTest, cancel_mid_run, reload_with_greet
from tests.mcp.mcp_tools import long_text
from tests.mcp.task_helpers import legacy_task, send, until_status


def bridge_command(mcp_server: McpUnderTest, key: str | None, **settings: str
                   ) -> StdioServerParameters:
    """``python -m stargrpc.cli mcp-stdio --target …`` with the key in STARGRPC_API_KEY
    (and ``settings`` as STARGRPC_ variables)."""
    env = {name: os.environ[name] for name in ("PATH", "HOME", "LANG") if name in os.environ}
    if key:
        env["STARGRPC_API_KEY"] = key
    env.update({f"STARGRPC_{name.upper()}": value for name, value in settings.items()})
    return StdioServerParameters(
        command=sys.executable,
        args=["-m", "stargrpc.cli", "mcp-stdio", "--target", mcp_server.auth.target],
        env=env)


async def test_list_call_with_progress_and_denial_over_stdio(mcp_server: McpUnderTest) -> None:
    seen: list[tuple[float, str | None]] = []

    async def progress(value: float, total: float | None, message: str | None) -> None:
        seen.append((value, message))

    viewer = mcp_server.auth.add_key("viewer")
    # Every step of the short count: progress from a call's start.
    async with Client(bridge_command(mcp_server, viewer, mcp_progress_after_seconds="0"),
                      read_timeout_seconds=30) as client:
        names = {tool.name for tool in (await client.list_tools()).tools}
        counted = await client.call_tool("count", {"to": 2}, progress_callback=progress)
        refused = await client.call_tool("ops_only", {})
        who = await client.call_tool("whoami", {})

    assert "count" in names and "ops_only" not in names
    assert counted.content == [types.TextContent(text="counted to 2")]
    assert "Counting to 2: 1" in [message for _, message in seen]
    assert refused.is_error
    assert refused.meta is not None
    assert refused.meta["stargrpc.dev/error-code"] == "TOOL_NOT_ALLOWED"
    assert isinstance(who.content[0], types.TextContent)
    assert "viewer" in who.content[0].text


async def test_no_key_over_stdio_is_an_unauthenticated_mcp_error(
        mcp_server: McpUnderTest) -> None:
    async with Client(bridge_command(mcp_server, None), read_timeout_seconds=30) as client:
        with pytest.raises(MCPError) as refused:
            await client.list_tools()
    assert refused.value.code == UNAUTHENTICATED


async def test_cancel_and_list_changed_over_stdio(
        mcp_server: McpUnderTest, gate: tuple[str, asyncio.Event, asyncio.Event],
        tmp_path: Any) -> None:
    name, _, cancelled = gate
    changed = asyncio.Event()

    async def on_message(message: Any) -> None:
        if isinstance(message, types.ToolListChangedNotification):
            changed.set()

    async with Client(bridge_command(mcp_server, mcp_server.auth.key), mode="legacy",
                      message_handler=on_message, read_timeout_seconds=30) as client:
        await cancel_mid_run(client, name, cancelled)
        await reload_with_greet(mcp_server.auth.server, tmp_path, changed)
        greeting = await client.call_tool("greet", {"name": "ada"})
    assert greeting.content == [types.TextContent(text="hello ada")]


async def test_a_long_output_links_to_all_of_it_over_stdio_too(
        mcp_server: McpUnderTest) -> None:
    chars = MAX_TEXT_CHARS + 10
    async with Client(bridge_command(mcp_server, mcp_server.auth.key),
                      read_timeout_seconds=30) as client:
        result = await client.call_tool("long_text", {"chars": chars})
        [link] = [b for b in result.content if isinstance(b, types.ResourceLink)]
        read = await client.read_resource(link.uri)
    [whole] = read.contents
    assert isinstance(whole, types.TextResourceContents)
    assert whole.text == long_text(chars)


async def test_tasks_over_stdio(mcp_server: McpUnderTest,
                                gate: tuple[str, asyncio.Event, asyncio.Event]) -> None:
    name, opened, _ = gate
    async with Client(bridge_command(mcp_server, mcp_server.auth.key), mode="legacy",
                      read_timeout_seconds=30) as client:
        assert client.protocol_version == "2025-11-25"
        assert client.server_capabilities.tasks is not None
        task = await legacy_task(client, "wait_at_gate", {"gate": name})
        assert (await until_status(client, task.task_id, ("working",)))["ttl"] >= 600_000
        opened.set()
        result = await send(client, "tasks/result", {"taskId": task.task_id},
                            types.CallToolResult)
    assert result.content == [types.TextContent(text="through the gate")]


async def test_a_line_the_bridge_cannot_read_is_answered_not_dropped(
        mcp_server: McpUnderTest) -> None:
    # The SDK's stdio server drops such a line, and its client waits for the answer
    # forever; each is answered with its JSON-RPC error, and the bridge serves on.
    params = bridge_command(mcp_server, mcp_server.auth.key)
    proc = await asyncio.create_subprocess_exec(
        params.command, *params.args, env=params.env, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    assert proc.stdin is not None and proc.stdout is not None
    lines = [
        '{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"echo",'
        '"arguments":{"text":"\\ud800"}}}',
        "not json at all",
        '{"jsonrpc":"2.0","id":"t","method":"tasks/get","params":{"taskId":"\\ud800"}}',
        '{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"x":"\\ud800"}}',
        '{"jsonrpc":"2.0","id":2,"method":"ping"}',
    ]
    try:
        proc.stdin.write("".join(line + "\n" for line in lines).encode())
        await proc.stdin.drain()
        answers = [json.loads(await asyncio.wait_for(proc.stdout.readline(), 30))
                   for _ in range(4)]
    finally:
        proc.kill()
        await proc.wait()
    by_id = {answer.get("id"): answer for answer in answers}
    assert by_id[1]["error"]["code"] == types.INVALID_PARAMS
    assert "lone surrogate" in by_id[1]["error"]["message"]
    assert by_id[None]["error"]["code"] == types.PARSE_ERROR
    assert by_id["t"]["error"]["code"] == types.INVALID_PARAMS
    assert by_id[2] == {"jsonrpc": "2.0", "id": 2, "result": {}}  # the notification: none
