"""A call's run events reach its MCP client once the call has run for
``mcp_progress_after_seconds``: a short call is answered with its result alone (in
2026-07-28, one JSON body), a long one shows the latest event held back, then each as it
comes. Real servers and the SDKs' own clients; the tests of every step of a short call
(threshold 0) are beside the features they check."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx2
import mcp_types as types
import pytest
from fastmcp import Client as FastMcpClient

from stargrpc.mcp.notifications import EventNotifications
from stargrpc.v1 import events_pb2
from tests.mcp.conftest import MODES, McpUnderTest


class CallAnswers:
    """The Content-Type of each ``tools/call`` answer an HTTP client received."""

    def __init__(self) -> None:
        self.content_types: list[str] = []

    async def __call__(self, response: httpx2.Response) -> None:
        if response.request.method != "POST":
            return
        try:
            body = json.loads(response.request.content)
        except ValueError:
            return
        if isinstance(body, dict) and body.get("method") == "tools/call":
            self.content_types.append(response.headers.get("content-type", ""))

    def hooks(self) -> dict[str, list[Any]]:
        return {"response": [self]}


@pytest.mark.parametrize("mode", MODES)
async def test_a_short_call_gets_its_result_alone(patient_mcp_server: McpUnderTest,
                                                  mode: str) -> None:
    progress: list[str | None] = []
    logged: list[types.LoggingMessageNotificationParams] = []
    answers = CallAnswers()

    async def on_progress(value: float, total: float | None, message: str | None) -> None:
        progress.append(message)

    async def on_log(params: types.LoggingMessageNotificationParams) -> None:
        logged.append(params)

    async with patient_mcp_server.client(mode=mode, event_hooks=answers.hooks(),
                                         logging_callback=on_log, log_level="info") as client:
        counted = await client.call_tool("count", {"to": 3}, progress_callback=on_progress)
        logged_call = await client.call_tool("count", {"to": 2})  # log messages, if any

    assert counted.content == [types.TextContent(text="counted to 3")]
    assert logged_call.content == [types.TextContent(text="counted to 2")]
    assert progress == [] and logged == []
    if mode != "legacy":  # the handshake era's HTTP answers are SSE streams whatever is sent
        assert answers.content_types == ["application/json", "application/json"]


@pytest.mark.parametrize("mode", MODES)
async def test_fastmcp_s_client_gets_a_short_call_s_result_alone(
        patient_mcp_server: McpUnderTest, mode: str) -> None:
    # FastMCP's client asks for progress on every call.
    progress: list[str | None] = []

    async def on_progress(value: float, total: float | None, message: str | None) -> None:
        progress.append(message)

    async with FastMcpClient(patient_mcp_server.url, auth=patient_mcp_server.auth.key,
                             mode=mode, timeout=30, progress_handler=on_progress) as client:
        echoed = await client.call_tool("echo", {"text": "hi"})

    assert echoed.content[0].text == "hi"  # type: ignore[union-attr]
    assert progress == []


#: What ``pause_at_gate`` shows once its gate is open.
AFTER_THE_GATE = ["Finishing", "Finishing: done", "Finishing: complete",
                  "pause_at_gate: complete"]


async def _through_the_gate(client: Any, gate: tuple[str, asyncio.Event, asyncio.Event],
                            reached: asyncio.Event, **options: Any) -> types.CallToolResult:
    """``pause_at_gate``, the gate opened once ``reached`` (the held event shown)."""
    name, opened, _ = gate
    call = asyncio.create_task(client.call_tool("pause_at_gate", {"gate": name}, **options))
    await asyncio.wait_for(reached.wait(), 20)
    opened.set()
    result: types.CallToolResult = await asyncio.wait_for(call, 20)
    return result


@pytest.mark.parametrize("mode", MODES)
async def test_a_long_call_shows_its_latest_held_progress_then_the_rest(
        mcp_server: McpUnderTest, gate: tuple[str, asyncio.Event, asyncio.Event],
        mode: str) -> None:
    # pause_at_gate's first step ends, then it waits in silence: its last event can only
    # reach the client by being released from the hold (the default threshold).
    seen: list[tuple[float, str | None]] = []
    reached = asyncio.Event()

    async def progress(value: float, total: float | None, message: str | None) -> None:
        seen.append((value, message))
        if message == "Preparing: complete":
            reached.set()

    async with mcp_server.client(mode=mode) as client:
        result = await _through_the_gate(client, gate, reached, progress_callback=progress)

    assert result.content == [types.TextContent(text="through the gate")]
    messages = [message for _, message in seen]
    # After the gate, every event as it comes (the last: the run's own step ending).
    assert messages[messages.index("Finishing"):] == AFTER_THE_GATE, messages
    values = [value for value, _ in seen]
    assert values == sorted(set(values))


@pytest.mark.parametrize("mode", MODES)
async def test_a_long_call_shows_its_latest_held_log_message_then_the_rest(
        mcp_server: McpUnderTest, gate: tuple[str, asyncio.Event, asyncio.Event],
        mode: str) -> None:
    logged: list[Any] = []
    reached = asyncio.Event()

    async def on_log(params: types.LoggingMessageNotificationParams) -> None:
        logged.append(params.data)
        if params.data["message"] == "Preparing: complete":
            reached.set()

    async with mcp_server.client(mode=mode, logging_callback=on_log,
                                 log_level="info") as client:
        result = await _through_the_gate(client, gate, reached)

    assert result.content == [types.TextContent(text="through the gate")]
    messages = [entry["message"] for entry in logged]
    assert messages[messages.index("Finishing"):] == AFTER_THE_GATE, messages
    seqs = [entry["seq"] for entry in logged]
    assert seqs == sorted(set(seqs))


# -- the hold itself, driven by hand ------------------------------------------------------


def _step(seq: int) -> events_pb2.RunEvent:
    return events_pb2.RunEvent(run_id="r1", seq=seq)


class Sent:
    def __init__(self) -> None:
        self.events: list[tuple[int, str, str]] = []

    async def __call__(self, event: events_pb2.RunEvent, text: str, level: str) -> None:
        self.events.append((event.seq, text, level))


async def test_held_events_give_way_to_the_latest_at_release() -> None:
    sent = Sent()
    async with EventNotifications(sent, 3600) as notifications:
        for seq in (1, 2, 3):
            await notifications.show(_step(seq), f"event {seq}")
        assert sent.events == []
        await notifications.release()
        assert sent.events == [(3, "event 3", "info")]
        await notifications.show(_step(4), "event 4", "warning")
        await notifications.release()  # nothing held: nothing more
    assert sent.events == [(3, "event 3", "info"), (4, "event 4", "warning")]


async def test_what_is_still_held_at_the_answer_is_never_sent() -> None:
    sent = Sent()
    notifications = EventNotifications(sent, 3600)
    await notifications.show(_step(1), "event 1")
    await notifications.close()
    await notifications.close()
    await notifications.release()
    assert sent.events == []


async def test_no_threshold_shows_every_event_and_levels_filter_log_messages() -> None:
    sent = Sent()
    async with EventNotifications(sent, 0, levels={"warning"}) as notifications:
        await notifications.show(_step(1), "chatter", "info")
        await notifications.show(_step(2), "careful", "warning")
    assert sent.events == [(2, "careful", "warning")]
    async with EventNotifications(None, 0) as silent:  # a request that may receive none
        await silent.show(_step(3), "unseen")
