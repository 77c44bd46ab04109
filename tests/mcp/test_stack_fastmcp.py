"""FastMCP's ``Client`` against the MCP endpoint, as an agent app uses it: listing, calls
with progress, cancellation, tool errors, credentials, and a long call as a task (the
``fastmcp-tasks`` client half of io.modelcontextprotocol/tasks, on a modern session)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fastmcp import Client
from fastmcp.exceptions import ToolError
from fastmcp_tasks import call_tool_task
from mcp.shared.exceptions import MCPError
from structlog.testing import capture_logs

from stargrpc.mcp.mapping import UNAUTHENTICATED
from tests.helpers import eventually
from tests.mcp.conftest import McpUnderTest
from tests.mcp.mcp_tools import CANCELLED, GATES
from tests.mcp.task_helpers import tasks_created

MODES = ("legacy", "auto")  # auto: server/discover, then 2026-07-28


def fastmcp_client(server: McpUnderTest, key: str | None = "", mode: str = "auto",
                   **options: Any) -> Client[Any]:
    """A FastMCP client with ``key`` as its bearer token (default: the admin key)."""
    token = server.auth.key if key == "" else key
    return Client(server.url, auth=token, mode=mode, timeout=30, **options)


@pytest.mark.parametrize("mode", MODES)
async def test_list_call_progress_and_tool_errors(eager_mcp_server: McpUnderTest,
                                                  mode: str) -> None:
    seen: list[tuple[float, str | None]] = []

    async def progress(value: float, total: float | None, message: str | None) -> None:
        seen.append((value, message))

    # Every step of the short count: progress from a call's start (threshold 0).
    async with fastmcp_client(eager_mcp_server, mode=mode,
                              progress_handler=progress) as client:
        names = {tool.name for tool in await client.list_tools()}
        assert {"echo", "count", "wait_at_gate", "measure"} <= names
        counted = await client.call_tool("count", {"to": 3})
        assert counted.content[0].text == "counted to 3"  # type: ignore[union-attr]
        measured = await client.call_tool("measure", {"size": 2})
        assert measured.data.x == 2 and measured.data.y == 4  # its output schema, typed
        with pytest.raises(ToolError, match="ERROR"):
            await client.call_tool("breaks", {})
        with pytest.raises(ToolError, match="to"):
            await client.call_tool("count", {"to": "many"})
        assert (await client.call_tool("echo", {"text": "still here"})).content[
            0].text == "still here"  # type: ignore[union-attr]
    assert "Counting to 3: 2" in [message for _, message in seen]


@pytest.mark.parametrize("mode", MODES)
async def test_cancelling_a_call_cancels_its_run(
        mcp_server: McpUnderTest, gate: tuple[str, asyncio.Event, asyncio.Event],
        mode: str) -> None:
    name, _, cancelled = gate
    waiting = asyncio.Event()

    async def progress(value: float, total: float | None, message: str | None) -> None:
        if message and "waiting at the gate" in message:
            waiting.set()

    async with fastmcp_client(mcp_server, mode=mode) as client:
        call = asyncio.create_task(client.call_tool("wait_at_gate", {"gate": name},
                                                    progress_handler=progress))
        await asyncio.wait_for(waiting.wait(), 20)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await asyncio.wait_for(cancelled.wait(), 10)


async def test_credentials_are_required_and_checked(mcp_server: McpUnderTest) -> None:
    for key, said in ((None, "missing credentials: send Authorization"),
                      ("not-a-key", "missing or invalid credentials")):
        with pytest.raises(MCPError, match=said) as refused:
            async with fastmcp_client(mcp_server, key=key) as client:
                await client.list_tools()
        assert refused.value.error.code == UNAUTHENTICATED
    limited = mcp_server.auth.add_key("limited", "user")
    async with fastmcp_client(mcp_server, key=limited) as client:
        assert "ops_only" not in {tool.name for tool in await client.list_tools()}
        with pytest.raises(ToolError, match="PERMISSION_DENIED"):
            await client.call_tool("ops_only", {})


async def test_a_long_call_is_a_task_the_client_drives(
        tasks_server: McpUnderTest, gate: tuple[str, asyncio.Event, asyncio.Event]) -> None:
    name, opened, cancelled = gate
    async with fastmcp_client(tasks_server) as client:
        # Transparent: call_tool polls the task to its result.
        with capture_logs() as logs:
            call = asyncio.create_task(client.call_tool("wait_at_gate", {"gate": name}))
            await eventually(lambda: tasks_created(logs), what="a task")  # answered: a task
            opened.set()
            result = await asyncio.wait_for(call, 30)
        assert tasks_created(logs) == ["wait_at_gate"]
        assert result.content[0].text == "through the gate"  # type: ignore[union-attr]
        # A handle: status, then cancel.
        other = name + "-handle"
        GATES[other], CANCELLED[other] = asyncio.Event(), cancelled
        try:
            task = await call_tool_task(client, "wait_at_gate", {"gate": other})
            status = await task.status()
            assert status.status == "working" and status.task_id == task.task_id
            await task.cancel()
            await asyncio.wait_for(cancelled.wait(), 10)
            final = await task.wait(timeout=20)
            assert final.status == "cancelled"
        finally:
            GATES.pop(other).set()
            CANCELLED.pop(other, None)
