"""FastMCP 4.2's ``Client`` against the MCP endpoint (issue 29), from a venv of its own: the
suite's venv holds FastMCP 4.1 for its tasks client (test_stack_fastmcp.py). What an agent
developer does with it, in both protocol eras: list the tools (schemas as the server lists
them), call one and read its text and structured content, a failing call raising as FastMCP
raises it, progress on a call that outlasts any progress threshold (and stays one request:
FastMCP 4.2 declares no tasks), cancellation, and a bearer key (none or a wrong one refused,
a narrower one seeing less)."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import sys
import textwrap
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from stargrpc.mcp.mapping import UNAUTHENTICATED
from tests.mcp.conftest import McpUnderTest
from tests.mcp.mcp_tools import CANCELLED, GATES
from tests.mcp.task_helpers import tasks_created
from tests.mcp.venvs import run_command

#: The FastMCP tested here, pinned. Not the suite's own: fastmcp-tasks 4.1.4, the newest
#: tasks client, requires exactly fastmcp 4.1.4, so the test extra pins that pair, while an
#: agent app without tasks takes the current FastMCP. Both are tested.
FASTMCP = "4.2.3"

#: Both eras FastMCP connects in, and the official client's mode for the same era: the
#: initialize handshake, and auto (server/discover, then 2026-07-28).
MODES = {"legacy": "legacy", "auto": "2026-07-28"}

#: A run's id, as failure texts name it.
RUN_ID = r"[0-9a-f]{32}"

#: The agent developer's session, once per mode. argv: url, admin key, a narrower key, then
#: per mode a gate to pass (the test opens it when the script says AT_GATE) and a gate at
#: which the call is cancelled. Prints one ``MODE:`` JSON line per mode.
FASTMCP_CALLS = textwrap.dedent('''
    import asyncio, json, sys
    import fastmcp
    from fastmcp import Client
    from fastmcp.exceptions import ToolError

    url, key, limited, modes = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(",")
    gates = sys.argv[5:]

    def say(tag, value):
        print(tag + ":" + json.dumps(value, default=str), flush=True)

    def texts(result):
        return [block.text for block in result.content if block.type == "text"]

    def refusal(error):
        inner = getattr(error, "error", None)
        return [type(error).__name__, getattr(inner, "code", None), str(error)]

    async def until_at_gate(client, gate, seen):
        """Calls wait_at_gate; returns once two of its heartbeats (0.2 s apart) came."""
        waiting, beats = asyncio.Event(), []

        async def on_progress(value, total, message):
            seen.append([value, total, message])
            if message and "waiting at the gate" in message:
                beats.append(value)
                if len(beats) == 2:
                    waiting.set()

        call = asyncio.create_task(
            client.call_tool("wait_at_gate", {"gate": gate}, progress_handler=on_progress))
        await asyncio.wait_for(waiting.wait(), 60)
        return call

    async def session(mode, passed, cancelled):
        out = {"mode": mode}
        async with Client(url, auth=key, mode=mode, timeout=60) as client:
            out["protocol"] = client.protocol_version
            tools = await client.list_tools()
            out["tools"] = {tool.name: tool.model_dump(mode="json", by_alias=True,
                                                       exclude_none=True) for tool in tools}
            counted = await client.call_tool("count", {"to": 3})
            out["count"] = {"text": texts(counted), "structured": counted.structured_content,
                            "data": counted.data, "is_error": counted.is_error}
            measured = await client.call_tool("measure", {"size": 2})
            out["measure"] = {"text": texts(measured),
                              "structured": measured.structured_content,
                              "data": [type(measured.data).__name__, measured.data.x,
                                       measured.data.y]}
            data = await client.call_tool("data", {})
            out["data"] = {"text": texts(data), "structured": data.structured_content,
                           "data": data.data}
            for name, arguments in (("breaks", {}), ("count", {"to": "many"})):
                try:
                    await client.call_tool(name, arguments)
                    out[name + "_raised"] = "returned"
                except ToolError as error:
                    out[name + "_raised"] = refusal(error)
            unraised = await client.call_tool("breaks", {}, raise_on_error=False)
            out["breaks_unraised"] = {"is_error": unraised.is_error, "text": texts(unraised)}
            # A call that outlasts any progress threshold and mcp_task_after_seconds (it
            # waits, heartbeating, until its progress has reached the handler): progress,
            # then its result, in the one request (FastMCP 4.2 declares no tasks).
            seen = []
            call = await until_at_gate(client, passed, seen)
            say("AT_GATE", passed)
            result = await asyncio.wait_for(call, 60)
            out["gate"] = {"text": texts(result), "progress": seen}
            # Cancelled once its run is under way.
            call = await until_at_gate(client, cancelled, [])
            call.cancel()
            try:
                await call
                out["cancelled"] = "returned"
            except asyncio.CancelledError:
                out["cancelled"] = "cancelled"
            out["after_cancel"] = texts(await client.call_tool("echo", {"text": "still here"}))
        for name, token in (("no_key", None), ("bad_key", "not-a-key")):
            try:
                async with Client(url, auth=token, mode=mode, timeout=60) as client:
                    await client.list_tools()
                out[name] = "accepted"
            except Exception as error:
                out[name] = refusal(error)
        async with Client(url, auth=limited, mode=mode, timeout=60) as client:
            out["limited_tools"] = sorted(tool.name for tool in await client.list_tools())
            try:
                await client.call_tool("ops_only", {})
                out["limited_call"] = "returned"
            except ToolError as error:
                out["limited_call"] = refusal(error)
        say("MODE", out)

    async def main():
        say("FASTMCP", fastmcp.__version__)
        for index, mode in enumerate(modes):
            await session(mode, gates[2 * index], gates[2 * index + 1])

    asyncio.run(main())
''')


def open_the_gate_it_waits_at(line: str) -> None:
    """Opens the gate an ``AT_GATE:`` line of the script names."""
    if line.startswith("AT_GATE:"):
        GATES[json.loads(line.split(":", 1)[1])].set()


@contextmanager
def gates(count: int) -> Iterator[list[str]]:
    """``count`` fresh gates for ``wait_at_gate`` (all opened at the end)."""
    names = [uuid.uuid4().hex for _ in range(count)]
    for name in names:
        GATES[name], CANCELLED[name] = asyncio.Event(), asyncio.Event()
    try:
        yield names
    finally:
        for name in names:
            GATES.pop(name).set()
            CANCELLED.pop(name, None)


@pytest.mark.timeout(900)  # a fresh venv and an install (from the pip cache): about a minute
async def test_fastmcp_4_2_client_lists_calls_and_authenticates(
        tasks_server: McpUnderTest, tmp_path: Path) -> None:
    # An endpoint that makes a task of a 2026-07-28 call running 0.2 s, for a client that
    # declares tasks: FastMCP 4.2's long calls must stay plain calls.
    mcp_server = tasks_server
    venv = tmp_path / "fastmcp42"
    await run_command(tmp_path, sys.executable, "-m", "venv", str(venv))
    python = venv / "bin" / "python"
    await run_command(tmp_path, str(python), "-m", "pip", "install", "-q", "--no-compile",
                      f"fastmcp=={FASTMCP}")
    limited = mcp_server.auth.add_key("limited", "user")
    listed = {}  # what the server lists in each era, as the official SDK reads it
    for mode, sdk_mode in MODES.items():
        async with mcp_server.client(mode=sdk_mode) as client:
            listed[mode] = {tool.name: tool.model_dump(mode="json", by_alias=True,
                                                       exclude_none=True)
                            for tool in (await client.list_tools()).tools}
    with gates(2 * len(MODES)) as names, capture_logs() as logs:
        out = await run_command(tmp_path, str(python), "-c", FASTMCP_CALLS, mcp_server.url,
                                mcp_server.auth.key, limited, ",".join(MODES), *names,
                                on_line=open_the_gate_it_waits_at)
        cancelled = [CANCELLED[name] for name in names[1::2]]
        for event in cancelled:  # each cancelled call stopped its run
            await asyncio.wait_for(event.wait(), 10)
    assert tasks_created(logs) == []
    lines = out.splitlines()
    assert f"FASTMCP:{json.dumps(FASTMCP)}" in lines, out  # the version the venv imported
    seen = {mode["mode"]: mode for mode in
            (json.loads(line.split(":", 1)[1]) for line in lines if line.startswith("MODE:"))}
    assert set(seen) == set(MODES), out
    assert seen["legacy"]["protocol"] == "2025-11-25"
    assert seen["auto"]["protocol"] == "2026-07-28"  # discovered, not fallen back
    for mode, got in seen.items():
        _assert_agent_session(got, listed[mode])


def _assert_agent_session(got: dict[str, Any], listed: dict[str, Any]) -> None:
    """What the script saw in one mode (``listed``: the tools as the server lists them)."""
    # The listing: every tool whole (schemas, annotations, _meta) as the server lists it.
    assert got["tools"] == listed
    schema = got["tools"]["count"]["inputSchema"]
    assert schema["required"] == ["to"] and schema["properties"]["to"]["type"] == "integer"
    assert got["tools"]["measure"]["outputSchema"]["properties"] == {
        "x": {"title": "X", "type": "integer"}, "y": {"title": "Y", "type": "integer"}}
    # A call: the text, and FastMCP's typed data from the output schema.
    count = got["count"]
    assert count["text"] == ["counted to 3"] and not count["is_error"]
    assert count["structured"] is None and count["data"] is None  # text only: no schema
    assert got["measure"]["structured"] == {"x": 2, "y": 4}
    assert got["measure"]["data"] == ["Point", 2, 4]
    assert json.loads(got["measure"]["text"][0]) == {"x": 2, "y": 4}
    assert got["data"]["structured"] == {"a": 1, "b": [1, 2.5], "c": "three"}
    assert json.loads(got["data"]["text"][0]) == got["data"]["structured"]
    # Failures: a tool error and refused arguments raise ToolError with the reason.
    kind, _, said = got["breaks_raised"]
    assert kind == "ToolError" and said.startswith("ERROR [TOOL_EXCEPTION]"), said
    assert "the internals of the failure" not in said
    kind, _, said = got["count_raised"]
    assert kind == "ToolError" and "[INVALID_ARGUMENT]" in said, said
    assert "arguments.to" in said, said
    assert got["breaks_unraised"]["is_error"] is True
    # raise_on_error=False: the same text, as the result (another run, another id).
    assert re.sub(RUN_ID, "", got["breaks_unraised"]["text"][0]) == re.sub(
        RUN_ID, "", got["breaks_raised"][2])
    # The long call: progress while it waited (each event once, in order), then its result.
    assert got["gate"]["text"] == ["through the gate"]
    messages = [message for _, _, message in got["gate"]["progress"]]
    assert any("waiting at the gate" in (message or "") for message in messages), messages
    values = [value for value, _, _ in got["gate"]["progress"]]
    assert all(a < b for a, b in itertools.pairwise(values))  # progress only grows
    assert got["cancelled"] == "cancelled"
    assert got["after_cancel"] == ["still here"]
    # The bearer key: none or a wrong one refused as FastMCP reports it.
    for refused, said in (("no_key", "missing credentials: send Authorization"),
                          ("bad_key", "missing or invalid credentials")):
        kind, code, message = got[refused]
        assert (kind, code) == ("MCPError", UNAUTHENTICATED), got[refused]
        assert said in message, got[refused]
    assert "ops_only" not in got["limited_tools"] and "echo" in got["limited_tools"]
    kind, _, said = got["limited_call"]
    assert kind == "ToolError" and "PERMISSION_DENIED" in said, said
