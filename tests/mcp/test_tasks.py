"""MCP tasks on runs, with the official SDK's client and types: 2025-11-25's experimental
tasks (the client asks) and 2026-07-28's io.modelcontextprotocol/tasks (the server decides),
the run-events extension, and hostile task requests."""

from __future__ import annotations

import asyncio
from typing import Any

import mcp_types as types
import pytest
from mcp.shared.exceptions import MCPError
from structlog.testing import capture_logs

from stargrpc.mcp import tasks as tasks_module
from stargrpc.mcp.run_events import RUN_EVENTS_EXTENSION, RUN_EVENTS_METHOD
from stargrpc.mcp.tasks import RELATED_TASK_META_KEY, TASKS_EXTENSION, waiting_message
from stargrpc.v1 import tool_service_pb2
from tests.helpers import eventually
from tests.mcp.conftest import McpUnderTest
from tests.mcp.mcp_tools import CANCELLED, GATES
from tests.mcp.task_helpers import (
    TERMINAL,
    AnyResult,
    TaskHandle,
    TasksExtension,
    TaskStatusWatcher,
    legacy_task,
    raw_request,
    send,
    tasks_created,
    until_status,
)

LEGACY = "legacy"
MODERN = "2026-07-28"


def acknowledged(answer: AnyResult) -> bool:
    """An empty result (2026-07-28: ``resultType`` and the server's ``_meta`` stamp)."""
    fields = answer.model_dump(by_alias=True, exclude_none=True)
    return fields.pop("resultType") == "complete" and set(fields) <= {"_meta"}


async def test_2025_capabilities_and_tools_offer_tasks(tasks_server: McpUnderTest) -> None:
    async with tasks_server.client(mode=LEGACY) as client:
        assert client.protocol_version == "2025-11-25"
        tasks = client.server_capabilities.tasks
        assert tasks is not None and tasks.list is not None and tasks.cancel is not None
        assert tasks.requests is not None and tasks.requests.tools is not None
        assert RUN_EVENTS_EXTENSION in (client.server_capabilities.experimental or {})
        tools = {tool.name: tool for tool in (await client.list_tools()).tools}
    assert tools["echo"].execution == types.ToolExecution(task_support="optional")


async def test_2025_task_get_result_list_and_status_notification(
        tasks_server: McpUnderTest, gate: tuple[str, asyncio.Event, asyncio.Event]) -> None:
    name, opened, _ = gate
    watcher = TaskStatusWatcher()
    async with tasks_server.client(mode=LEGACY, extensions=[watcher]) as client:
        task = await legacy_task(client, "wait_at_gate", {"gate": name}, ttl=60_000)
        assert task.status == "working"
        assert task.ttl is not None and task.ttl >= 120_000  # the run retention, at least
        got = types.GetTaskResult.model_validate(
            (await send(client, "tasks/get", {"taskId": task.task_id})).model_dump())
        assert got.task_id == task.task_id and got.status == "working"
        listed = await send(client, "tasks/list", {})
        assert task.task_id in [t["taskId"] for t in listed.model_dump()["tasks"]]
        waiting = asyncio.create_task(
            send(client, "tasks/result", {"taskId": task.task_id}, types.CallToolResult))
        await asyncio.sleep(0)
        assert not waiting.done()
        opened.set()
        result = await asyncio.wait_for(waiting, 30)
        assert result.content == [types.TextContent(text="through the gate")]
        assert (result.meta or {})[RELATED_TASK_META_KEY] == {"taskId": task.task_id}
        done = await until_status(client, task.task_id, ("completed",))
        assert done["statusMessage"] == "completed"
        assert done["lastUpdatedAt"] >= done["createdAt"]
        await asyncio.wait_for(watcher.arrived.wait(), 10)  # on the session's own stream
    assert [(s.task_id, s.status) for s in watcher.statuses] == [(task.task_id, "completed")]


async def test_2025_a_task_result_is_what_the_call_answers(tasks_server: McpUnderTest) -> None:
    async with tasks_server.client(mode=LEGACY) as client:
        task = await legacy_task(client, "measure", {"size": 2})
        result = await send(client, "tasks/result", {"taskId": task.task_id},
                            types.CallToolResult)
        direct = await client.call_tool("measure", {"size": 2})
    assert result.structured_content == direct.structured_content == {"x": 2, "y": 4}
    assert [block.type for block in result.content] == [block.type for block in direct.content]
    assert (result.meta or {})["stargrpc.dev/run-id"] == task.task_id


async def test_2025_cancel_ends_the_run_and_a_finished_task_cannot_be_cancelled(
        tasks_server: McpUnderTest, gate: tuple[str, asyncio.Event, asyncio.Event]) -> None:
    name, _, cancelled = gate
    async with tasks_server.client(mode=LEGACY) as client:
        task = await legacy_task(client, "wait_at_gate", {"gate": name})
        answer = (await send(client, "tasks/cancel", {"taskId": task.task_id})).model_dump()
        assert answer["status"] == "cancelled"
        await asyncio.wait_for(cancelled.wait(), 10)
        result = await send(client, "tasks/result", {"taskId": task.task_id},
                            types.CallToolResult)
        assert result.is_error
        with pytest.raises(MCPError) as refused:
            await send(client, "tasks/cancel", {"taskId": task.task_id})
        assert refused.value.error.code == types.INVALID_PARAMS
        assert "terminal status 'cancelled'" in refused.value.error.message
        # A failed tool's task is failed (2025-11-25), its result the tool error.
        broken = await legacy_task(client, "breaks", {})
        failed = await until_status(client, broken.task_id, ("completed", "failed"))
        assert failed["status"] == "failed" and failed["statusMessage"].startswith("ERROR")


async def test_2026_quick_calls_answer_inline_long_ones_become_tasks(
        mcp_server: McpUnderTest, tasks_server: McpUnderTest,
        gate: tuple[str, asyncio.Event, asyncio.Event]) -> None:
    name, opened, _ = gate
    async with tasks_server.client(mode="auto") as client:  # server/discover
        assert client.protocol_version == MODERN
        extensions = client.server_capabilities.extensions or {}
        assert extensions[TASKS_EXTENSION] == {}
        assert extensions[RUN_EVENTS_EXTENSION]["method"] == RUN_EVENTS_METHOD
    # A quick call is answered inline (within the default mcp_task_after_seconds, 2 s).
    async with mcp_server.client(mode=MODERN, extensions=[TasksExtension()]) as client:
        quick = await client.session.call_tool("echo", {"text": "at once"}, allow_claimed=True)
        assert isinstance(quick, types.CallToolResult)
        assert quick.content == [types.TextContent(text="at once")]
    async with tasks_server.client(mode=MODERN, extensions=[TasksExtension()]) as client:
        long = await client.session.call_tool("wait_at_gate", {"gate": name},
                                              allow_claimed=True)
        assert isinstance(long, TaskHandle) and long.status == "working"
        working = await until_status(client, long.task_id, ("working",))
        assert "result" not in working and working["ttlMs"] >= 120_000
        assert working["statusMessage"].startswith("running")
        opened.set()
        done = await until_status(client, long.task_id, ("completed",))
        result = types.CallToolResult.model_validate(done["result"])
        assert result.content == [types.TextContent(text="through the gate")]
        # No run asks for input: an update is acknowledged (and changes nothing).
        update = {"taskId": long.task_id, "inputResponses": {"name": {"action": "decline"}}}
        assert acknowledged(await send(client, "tasks/update", update))
        with pytest.raises(MCPError) as unknown:
            await send(client, "tasks/update", {**update, "taskId": "0" * 32})
        assert unknown.value.error.code == types.INVALID_PARAMS
        # tasks/result and tasks/list are not of this version.
        for method in ("tasks/result", "tasks/list"):
            with pytest.raises(MCPError) as missing:
                await send(client, method, {"taskId": long.task_id})
            assert missing.value.error.code == types.METHOD_NOT_FOUND
    # A client that does not declare the extension is never given a task, and may not
    # use the task methods (-32021).
    async with tasks_server.client(mode=MODERN) as plain:
        assert (await plain.call_tool("echo", {"text": "plain"})).content == [
            types.TextContent(text="plain")]
        with pytest.raises(MCPError) as refused:
            await send(plain, "tasks/get", {"taskId": long.task_id})
        assert refused.value.error.code == -32021


async def test_2026_the_sdk_extension_resolves_a_task_transparently(
        tasks_server: McpUnderTest, gate: tuple[str, asyncio.Event, asyncio.Event]) -> None:
    name, opened, _ = gate
    async with tasks_server.client(mode=MODERN, extensions=[TasksExtension()]) as client:
        with capture_logs() as logs:
            call = asyncio.create_task(client.call_tool("wait_at_gate", {"gate": name}))
            await eventually(lambda: tasks_created(logs), what="a task")
            opened.set()
            result = await asyncio.wait_for(call, 30)
    assert result.content == [types.TextContent(text="through the gate")]
    assert tasks_created(logs) == ["wait_at_gate"]


async def test_2026_cancel_is_acknowledged_and_the_task_ends_cancelled(
        tasks_server: McpUnderTest, gate: tuple[str, asyncio.Event, asyncio.Event]) -> None:
    name, _, cancelled = gate
    async with tasks_server.client(mode=MODERN, extensions=[TasksExtension()]) as client:
        long = await client.session.call_tool("wait_at_gate", {"gate": name},
                                              allow_claimed=True)
        assert isinstance(long, TaskHandle)
        ack = await send(client, "tasks/cancel", {"taskId": long.task_id})
        assert acknowledged(ack)
        await asyncio.wait_for(cancelled.wait(), 10)
        done = await until_status(client, long.task_id, ("cancelled",))
        assert "result" not in done
        # Cancelling a finished task is acknowledged too (cancelling is cooperative).
        assert acknowledged(await send(client, "tasks/cancel", {"taskId": long.task_id}))


@pytest.mark.parametrize("mode", [LEGACY, MODERN])
async def test_run_events_extension_resumes_after_a_seq(
        tasks_server: McpUnderTest, mode: str) -> None:
    async with tasks_server.client(mode=mode) as client:
        if mode == LEGACY:
            task_id = (await legacy_task(client, "count", {"to": 3})).task_id
        else:
            result = await client.call_tool("count", {"to": 3})
            task_id = (result.meta or {})["stargrpc.dev/run-id"]
        first = (await send(client, RUN_EVENTS_METHOD, {"taskId": task_id, "maxEvents": 2,
                                                         "waitMs": 5000})).model_dump(
            by_alias=True)
        assert [e["seq"] for e in first["events"]] == ["1", "2"] or [
            int(e["seq"]) for e in first["events"]] == [1, 2]
        rest: list[dict[str, Any]] = []
        after = first["lastSeq"]
        while True:
            page = (await send(client, RUN_EVENTS_METHOD, {
                "taskId": task_id, "afterSeq": after, "waitMs": 5000})
                    ).model_dump(by_alias=True)
            rest += page["events"]
            after = page["lastSeq"]
            if page["finished"]:
                break
        assert "result" in rest[-1]
        seqs = [int(e["seq"]) for e in first["events"] + rest]
        assert seqs == list(range(1, len(seqs) + 1))
        past = (await send(client, RUN_EVENTS_METHOD, {"taskId": task_id, "afterSeq": after})
                ).model_dump(by_alias=True)
        assert past["events"] == [] and past["finished"] and past["lastSeq"] == after


@pytest.mark.parametrize("mode", [LEGACY, MODERN])
async def test_hostile_task_requests_get_precise_errors(
        tasks_server: McpUnderTest, gate: tuple[str, asyncio.Event, asyncio.Event],
        mode: str) -> None:
    name, opened, _ = gate
    other = tasks_server.auth.add_key("other", "user")
    async with tasks_server.client(mode=LEGACY) as owner:
        mine = (await legacy_task(owner, "wait_at_gate", {"gate": name})).task_id
    forged = mine[:-4] + ("0000" if not mine.endswith("0000") else "1111")
    takes_tasks = [TasksExtension()] if mode == MODERN else []
    async with tasks_server.client(key=other, mode=mode, extensions=takes_tasks) as client:
        for task_id in (forged, "x" * 200, "../../etc", mine):  # mine: another principal's
            for method in ("tasks/get", "tasks/cancel", RUN_EVENTS_METHOD):
                with pytest.raises(MCPError) as refused:
                    await send(client, method, {"taskId": task_id})
                assert refused.value.error.code == types.INVALID_PARAMS, (method, task_id)
                assert "not found" in refused.value.error.message.lower()
        for params in ({}, {"taskId": 7}, {"taskId": "y" * 5000}, {"taskId": ""}):
            with pytest.raises(MCPError) as malformed:
                await send(client, "tasks/get", params)
            assert malformed.value.error.code == types.INVALID_PARAMS
        for params in ({"taskId": mine, "afterSeq": -1}, {"taskId": mine, "maxEvents": 10**9},
                       {"taskId": mine, "waitMs": "soon"}):
            with pytest.raises(MCPError) as malformed:
                await send(client, RUN_EVENTS_METHOD, params)
            assert malformed.value.error.code == types.INVALID_PARAMS
        if mode == LEGACY:
            with pytest.raises(MCPError) as bad_cursor:
                await send(client, "tasks/list", {"cursor": "forged"})
            assert bad_cursor.value.error.code == types.INVALID_PARAMS
            listed = await send(client, "tasks/list", {})
            assert mine not in [t["taskId"] for t in listed.model_dump()["tasks"]]
            for ttl in (-1, 10**30):
                if ttl < 0:
                    with pytest.raises(MCPError) as negative:
                        await legacy_task(client, "echo", {"text": "x"}, ttl=ttl)
                    assert negative.value.error.code == types.INVALID_PARAMS
                else:  # huge: served, the actual ttl stated
                    task = await legacy_task(client, "echo", {"text": "x"}, ttl=ttl)
                    assert task.ttl is not None and task.ttl < 10**30
            for task in ("soon", {"ttl": "long"}, [1]):
                with pytest.raises(MCPError) as malformed_task:
                    await raw_request(client, "tools/call",
                                      {"name": "echo", "arguments": {}, "task": task})
                assert malformed_task.value.error.code == types.INVALID_PARAMS
            with pytest.raises(MCPError) as unknown_tool:
                await legacy_task(client, "no_such_tool", {})
            assert unknown_tool.value.error.code == types.INVALID_PARAMS
            with pytest.raises(MCPError) as bad_args:
                await legacy_task(client, "count", {"to": "many"})
            assert bad_args.value.error.code == types.INVALID_PARAMS
        # The server keeps serving.
        assert (await client.call_tool("echo", {"text": "still here"})).content == [
            types.TextContent(text="still here")]
    opened.set()
    assert AnyResult  # the helper type is what every answer above was read into


async def test_a_task_made_on_one_replica_is_answered_by_another(
        mcp_replicas: tuple[McpUnderTest, McpUnderTest],
        gate: tuple[str, asyncio.Event, asyncio.Event]) -> None:
    first, second = mcp_replicas
    name, opened, cancelled = gate
    async with first.client(mode=LEGACY) as on_a, second.client(mode=LEGACY) as on_b:
        task = await legacy_task(on_a, "wait_at_gate", {"gate": name})
        got = await until_status(on_b, task.task_id, ("working",))
        assert got["taskId"] == task.task_id
        assert task.task_id in [t["taskId"] for t in (
            await send(on_b, "tasks/list", {})).model_dump()["tasks"]]
        waiting = asyncio.create_task(
            send(on_b, "tasks/result", {"taskId": task.task_id}, types.CallToolResult))
        opened.set()
        result = await asyncio.wait_for(waiting, 30)
        assert result.content == [types.TextContent(text="through the gate")]
        assert (await until_status(on_b, task.task_id, TERMINAL))["status"] == "completed"
    # 2026-07-28: made on the second replica, cancelled and read on the first.
    other_gate = name + "-2"
    GATES[other_gate], CANCELLED[other_gate] = asyncio.Event(), cancelled
    try:
        async with second.client(mode=MODERN, extensions=[TasksExtension()]) as on_b, \
                first.client(mode=MODERN, extensions=[TasksExtension()]) as on_a:
            long = await on_b.session.call_tool("wait_at_gate", {"gate": other_gate},
                                                allow_claimed=True)
            assert isinstance(long, TaskHandle)
            assert (await until_status(on_a, long.task_id, ("working",)))["status"] == "working"
            assert acknowledged(await send(on_a, "tasks/cancel", {"taskId": long.task_id}))
            await asyncio.wait_for(cancelled.wait(), 15)
            assert (await until_status(on_a, long.task_id, TERMINAL))["status"] == "cancelled"
            assert (await until_status(on_b, long.task_id, TERMINAL))["status"] == "cancelled"
    finally:
        GATES.pop(other_gate).set()
        CANCELLED.pop(other_gate, None)


def test_a_waiting_run_says_where_it_waits() -> None:
    # RunState 3 and 4 are the lanes' and approval's (the run-state seam's numbers).
    summary = tool_service_pb2.RunSummary(state=3)
    assert waiting_message(summary) == "queued"
    summary = tool_service_pb2.RunSummary(state=4)
    assert waiting_message(summary).startswith("awaiting approval")
    summary = tool_service_pb2.RunSummary(state=tool_service_pb2.RUN_STATE_RUNNING,
                                          current_step="Counting to 3")
    assert waiting_message(summary) == "running: Counting to 3"
    assert waiting_message(tool_service_pb2.RunSummary(state=1)) == "running"


async def test_a_task_past_the_runs_listed_is_read_through_watchrun(
        tasks_server: McpUnderTest, gate: tuple[str, asyncio.Event, asyncio.Event],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # ListRuns is asked for the newest run only: older tasks are found by WatchRun.
    monkeypatch.setattr(tasks_module, "_PAGE", 1)
    monkeypatch.setattr(tasks_module, "_SCAN_PAGES", 1)
    monkeypatch.setattr(tasks_module, "_PROBE_SECONDS", 0.5)
    name, opened, _ = gate
    async with tasks_server.client(mode=LEGACY) as client:
        going = await legacy_task(client, "wait_at_gate", {"gate": name})
        done = await legacy_task(client, "echo", {"text": "done"})
        await send(client, "tasks/result", {"taskId": done.task_id}, types.CallToolResult)
        newest = await legacy_task(client, "echo", {"text": "newest"})
        await send(client, "tasks/result", {"taskId": newest.task_id}, types.CallToolResult)
        got = (await send(client, "tasks/get", {"taskId": going.task_id})).model_dump()
        assert got["status"] == "working"
        got = (await send(client, "tasks/get", {"taskId": done.task_id})).model_dump()
        assert got["status"] == "completed" and got["statusMessage"] == "completed"
        for unknown in ("0" * 32, going.task_id[:-1] + "x"):
            with pytest.raises(MCPError) as refused:
                await send(client, "tasks/get", {"taskId": unknown})
            assert refused.value.error.code == types.INVALID_PARAMS
        opened.set()
