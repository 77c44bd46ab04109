"""The MCP endpoint (``mcp_port``) with the official SDK's client over streamable HTTP:
the same pipeline as gRPC Execute behind every MCP request."""

from __future__ import annotations

import asyncio
import base64
import logging
from typing import Any

import anyio
import httpx2
import mcp_types as types
import pytest
from mcp.shared.exceptions import MCPError

from stargrpc.mcp.mapping import IDEMPOTENCY_META_KEY, UNAUTHENTICATED
from tests.conftest import AuthServerFactory
from tests.helpers import eventually
from tests.mcp.conftest import (
    GREET,
    MODES,
    McpUnderTest,
    cancel_mid_run,
    reload_with_greet,
)
from tests.mcp.mcp_tools import BIG, TALLY, mcp_registry


@pytest.mark.parametrize("mode", MODES)
async def test_tools_list_carries_schemas_and_annotations(mcp_server: McpUnderTest,
                                                          mode: str) -> None:
    async with mcp_server.client(mode=mode) as client:
        tools = {tool.name: tool for tool in (await client.list_tools()).tools}

    measure = tools["measure"]
    assert measure.description and measure.description.startswith("Measure something")
    assert measure.input_schema["properties"]["size"]["maximum"] == 100
    # Whole numbers stay integers on the way through the catalog's protobuf Struct: a
    # strictly typed client reads "maximum": 100, not 100.0.
    bound = tools["count"].input_schema["properties"]["to"]
    assert (type(bound["minimum"]), type(bound["maximum"])) == (int, int)
    assert measure.output_schema is not None
    assert set(measure.output_schema["properties"]) == {"x", "y"}
    assert measure.annotations == types.ToolAnnotations(
        read_only_hint=True, destructive_hint=False, idempotent_hint=True,
        open_world_hint=False)
    assert tools["breaks"].annotations is not None
    assert tools["breaks"].annotations.destructive_hint is True
    assert {"echo", "count", "wait_at_gate", "ops_only"} <= set(tools)


@pytest.mark.parametrize("mode", MODES)
async def test_call_reports_steps_and_deltas_as_monotonic_progress(
        eager_mcp_server: McpUnderTest, mode: str) -> None:
    # Every event of a short call, from its start: mcp_progress_after_seconds = 0.
    seen: list[tuple[float, str | None]] = []

    async def progress(value: float, total: float | None, message: str | None) -> None:
        seen.append((value, message))

    async with eager_mcp_server.client(mode=mode) as client:
        result = await client.call_tool("count", {"to": 3}, progress_callback=progress)

    assert not result.is_error
    assert result.content == [types.TextContent(text="counted to 3")]
    values = [value for value, _ in seen]
    assert values == sorted(set(values)) and len(values) >= 5
    messages = [message for _, message in seen]
    assert "Counting to 3" in messages          # the step's title when it starts
    assert "Counting to 3: 2" in messages       # then the title and the latest delta


@pytest.mark.parametrize("mode", MODES)
async def test_without_a_progress_token_events_arrive_as_log_messages(
        eager_mcp_server: McpUnderTest, mode: str) -> None:
    logged: list[types.LoggingMessageNotificationParams] = []

    async def on_log(params: types.LoggingMessageNotificationParams) -> None:
        logged.append(params)

    async with eager_mcp_server.client(mode=mode, logging_callback=on_log,
                                 log_level="info") as client:
        result = await client.call_tool("count", {"to": 2})

    assert result.content == [types.TextContent(text="counted to 2")]
    texts = [entry.data["message"] for entry in logged]
    assert "Counting to 2: 1" in texts
    assert all(entry.logger == "stargrpc" and entry.data["run_id"] for entry in logged)


async def test_structured_output_and_sent_files(mcp_server: McpUnderTest) -> None:
    async with mcp_server.client() as client:
        result = await client.call_tool("measure", {"size": 3})

    assert not result.is_error
    assert result.structured_content == {"x": 3, "y": 6}
    text, note, picture = result.content
    assert isinstance(text, types.TextContent)
    assert isinstance(note, types.EmbeddedResource)
    assert isinstance(note.resource, types.TextResourceContents)
    assert note.resource.text == "measured\n"
    assert note.resource.uri.endswith("/note.txt")
    assert isinstance(picture, types.EmbeddedResource)
    assert isinstance(picture.resource, types.BlobResourceContents)
    assert picture.resource.mime_type == "image/png"
    assert base64.b64decode(picture.resource.blob) == b"\x89PNG\r\n\x1a\nfake"
    assert result.meta is not None and result.meta["stargrpc.dev/outcome"] == "OK"


async def test_a_file_sent_in_chunks_comes_back_whole(
        make_auth_server: AuthServerFactory) -> None:
    small = McpUnderTest(await make_auth_server(
        mcp_registry(), mcp_port=0, inline_file_bytes=1024, file_chunk_bytes=1024))
    async with small.client() as client:
        result = await client.call_tool("big_file", {})

    file = result.content[1]
    assert isinstance(file, types.EmbeddedResource)
    assert isinstance(file.resource, types.TextResourceContents)
    assert file.resource.text.encode() == BIG


async def test_a_failing_tool_is_an_error_result_with_its_code_and_no_internals(
        mcp_server: McpUnderTest) -> None:
    async with mcp_server.client() as client:
        result = await client.call_tool("breaks", {})

    assert result.is_error
    shown = result.content[0]
    assert isinstance(shown, types.TextContent)
    assert shown.text.startswith("ERROR [TOOL_EXCEPTION]")
    assert "internals" not in shown.text
    assert result.meta is not None and result.meta["stargrpc.dev/error-code"] == "TOOL_EXCEPTION"


async def test_unknown_tool_is_invalid_params_and_bad_arguments_name_the_field(
        mcp_server: McpUnderTest) -> None:
    async with mcp_server.client() as client:
        with pytest.raises(MCPError) as unknown:
            await client.call_tool("no_such_tool", {})
        bad = await client.call_tool("count", {"to": "many"})
        fine = await client.call_tool("echo", {"text": "still serving"})

    assert unknown.value.code == types.INVALID_PARAMS
    assert unknown.value.data["reason"] == "TOOL_NOT_FOUND"
    assert bad.is_error
    assert isinstance(bad.content[0], types.TextContent)
    assert "INVALID_ARGUMENT" in bad.content[0].text
    assert "arguments.to" in bad.content[0].text
    assert fine.content == [types.TextContent(text="still serving")]


async def test_a_refused_caller_gets_an_error_result_and_a_trimmed_list(
        mcp_server: McpUnderTest) -> None:
    viewer = mcp_server.auth.add_key("viewer")
    async with mcp_server.client(key=viewer) as client:
        listed = {tool.name for tool in (await client.list_tools()).tools}
        refused = await client.call_tool("ops_only", {})
        who = await client.call_tool("whoami", {})

    assert "ops_only" not in listed and "whoami" in listed
    assert refused.is_error
    assert refused.meta is not None
    assert refused.meta["stargrpc.dev/error-code"] == "TOOL_NOT_ALLOWED"
    assert isinstance(refused.content[0], types.TextContent)
    assert refused.content[0].text.startswith("PERMISSION_DENIED")
    # the principal is the one of the forwarded key, never the endpoint's
    assert isinstance(who.content[0], types.TextContent)
    assert "viewer" in who.content[0].text and "api_key" in who.content[0].text


async def test_no_credentials_or_a_wrong_key_is_401_with_an_mcp_error(
        mcp_server: McpUnderTest) -> None:
    initialize = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "t", "version": "1"}}}
    async with httpx2.AsyncClient(timeout=30) as http:
        answer = await http.post(mcp_server.url, json=initialize, headers={
            "Accept": "application/json, text/event-stream"})
    assert answer.status_code == 401
    assert answer.headers["www-authenticate"].startswith("Bearer")

    assert answer.json()["error"]["code"] == UNAUTHENTICATED

    # a wrong key gets no further than initialize (no session is opened for it)
    with pytest.raises(BaseExceptionGroup) as refused:
        async with mcp_server.client(key="sgk_wrong_key") as client:
            await client.list_tools()
    assert refused.group_contains(MCPError, match="invalid credentials", depth=None)

    async with mcp_server.client() as client:  # and the endpoint keeps serving
        result = await client.call_tool("echo", {"text": "after"})
    assert result.content == [types.TextContent(text="after")]


async def test_two_authorization_headers_are_refused_as_over_grpc(
        mcp_server: McpUnderTest) -> None:
    initialize = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "t", "version": "1"}}}
    viewer = mcp_server.auth.add_key("viewer")

    async def status(*credentials: str) -> int:
        headers = [("Accept", "application/json, text/event-stream"),
                   *(("Authorization", f"Bearer {key}") for key in credentials)]
        async with httpx2.AsyncClient(timeout=30) as http:
            return (await http.post(mcp_server.url, json=initialize, headers=headers)
                    ).status_code

    # Which of two credentials counts is not the endpoint's to pick (a proxy in front may
    # have added its own after the client's): neither does, as with two in gRPC metadata.
    assert await status(viewer, mcp_server.auth.key) == 401
    assert await status(mcp_server.auth.key, "sgk_wrong_key") == 401
    assert await status(viewer) == 200


@pytest.mark.parametrize("mode", MODES)
async def test_cancelling_the_request_cancels_the_run(
        mcp_server: McpUnderTest, gate: tuple[str, asyncio.Event, asyncio.Event],
        mode: str) -> None:
    name, _, cancelled = gate
    async with mcp_server.client(mode=mode) as client:
        await cancel_mid_run(client, name, cancelled)
        again = await client.call_tool("echo", {"text": "next"})

    assert again.content == [types.TextContent(text="next")]


async def test_a_client_going_away_mid_call_cancels_the_run(
        mcp_server: McpUnderTest, gate: tuple[str, asyncio.Event, asyncio.Event]) -> None:
    name, _, cancelled = gate
    waiting = asyncio.Event()

    async def progress(value: float, total: float | None, message: str | None) -> None:
        if message and "waiting at the gate" in message:
            waiting.set()

    async def connected() -> None:  # the whole client: its session and HTTP connection
        async with mcp_server.client() as client:
            await client.call_tool("wait_at_gate", {"gate": name}, progress_callback=progress)

    going = asyncio.create_task(connected())
    await asyncio.wait_for(waiting.wait(), 20)
    going.cancel()
    with pytest.raises(asyncio.CancelledError):
        await going
    await asyncio.wait_for(cancelled.wait(), 10)  # the run's tool was cancelled
    async with mcp_server.client() as client:  # and the endpoint keeps serving
        result = await client.call_tool("echo", {"text": "after"})
    assert result.content == [types.TextContent(text="after")]


async def test_the_idempotency_meta_key_replays_instead_of_running_again(
        mcp_server: McpUnderTest) -> None:
    meta: Any = {IDEMPOTENCY_META_KEY: "order-42"}
    async with mcp_server.client() as client:
        first = await client.call_tool("tally", {}, meta=meta)
        replay = await client.call_tool("tally", {}, meta=meta)
        fresh = await client.call_tool("tally", {})
        with pytest.raises(MCPError) as bad:
            await client.call_tool("tally", {}, meta={IDEMPOTENCY_META_KEY: 42})  # type: ignore[typeddict-unknown-key]

    assert replay.content == first.content
    assert first.meta is not None and replay.meta is not None
    assert replay.meta["stargrpc.dev/run-id"] == first.meta["stargrpc.dev/run-id"]
    assert fresh.content != first.content
    assert bad.value.code == types.INVALID_PARAMS
    assert TALLY[0] >= 2


async def test_list_changed_reaches_handshake_era_clients(mcp_server: McpUnderTest,
                                                         tmp_path: Any) -> None:
    changed = asyncio.Event()

    async def on_message(message: Any) -> None:
        if isinstance(message, types.ToolListChangedNotification):
            changed.set()

    async with mcp_server.client(mode="legacy", message_handler=on_message) as client:
        assert client.server_capabilities.tools is not None
        assert client.server_capabilities.tools.list_changed
        await client.list_tools()
        await reload_with_greet(mcp_server.auth.server, tmp_path, changed)
        await asyncio.wait_for(changed.wait(), 10)
        tools = {tool.name for tool in (await client.list_tools()).tools}
        greeting = await client.call_tool("greet", {"name": "ada"})
    assert "greet" in tools
    assert greeting.content == [types.TextContent(text="hello ada")]


async def test_list_changed_reaches_listen_subscribers(mcp_server: McpUnderTest,
                                                      tmp_path: Any) -> None:
    async with mcp_server.client(mode="2026-07-28") as client:
        async with client.listen(tools_list_changed=True) as subscription:
            assert subscription.honored.tools_list_changed
            (tmp_path / "extra_tools" / "greet.py").write_text(GREET)
            mcp_server.auth.server.reload_tools()  # what SIGHUP does
            with anyio.fail_after(10):
                async for _event in subscription:
                    break
        tools = {tool.name for tool in (await client.list_tools(cache_mode="refresh")).tools}
    assert "greet" in tools


async def test_a_client_hanging_up_mid_request_is_one_line_not_an_error(
        mcp_server: McpUnderTest, caplog: pytest.LogCaptureFixture) -> None:
    # Any key holder could repeat it: the SDK's error with a whole traceback each time
    # becomes one line at INFO, and the endpoint serves on.
    caplog.set_level(logging.INFO)
    assert mcp_server.auth.server.mcp is not None
    port = mcp_server.auth.server.mcp.port
    for _ in range(3):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
                     + mcp_server.auth.key.encode() + b"\r\nContent-Type: application/json"
                     b"\r\nAccept: application/json, text/event-stream\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"jsonrpc\"")
        await writer.drain()
        writer.close()

    def went_away() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.name == "mcp.server.streamable_http"
                and "the client went away" in r.getMessage()]

    await eventually(lambda: len(went_away()) == 3, what="each hang-up logged")
    assert all(r.levelno == logging.INFO and not r.exc_info for r in went_away())
    assert not [r for r in caplog.records if r.name.startswith("mcp.")
                and r.levelno >= logging.ERROR]
    async with mcp_server.client() as client:
        assert (await client.list_tools()).tools
