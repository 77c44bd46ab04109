"""Outcome classification through a real server, and cancellation by the client."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator

import grpc
import pytest
from pydantic import BaseModel, field_validator

from stargrpc import ToolContext, ToolDenied, ToolResult, tool
from stargrpc.registry import Registry, spec_of
from stargrpc.runs.outcome import Outcome
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.helpers import phases, run_tool


class Nothing(BaseModel):
    pass


@tool()
async def explode(ctx: ToolContext, args: Nothing) -> str:
    """Raise an unexpected exception carrying an internal detail."""
    async with ctx.step("about to fail"):
        raise RuntimeError("db password is hunter2 at /srv/secret.py line 12")


@tool()
async def legacy_failure(ctx: ToolContext, args: Nothing) -> dict[str, object]:
    """Return a legacy-shaped failure dict."""
    return {"success": False, "error": "the upstream service timed out"}


@tool()
async def legacy_denial(ctx: ToolContext, args: Nothing) -> dict[str, object]:
    """Return a legacy-shaped denial."""
    return {"success": False,
        "error": "user bob does not have the ADMIN privilege on project x"}


@tool()
async def refuses(ctx: ToolContext, args: Nothing) -> str:
    """Raise ToolDenied."""
    raise ToolDenied("not authorized to read that mailbox")


@tool()
async def explicit(ctx: ToolContext, args: Nothing) -> ToolResult:
    """Return an explicit FAILED result."""
    return ToolResult(output="half done", outcome=Outcome.FAILED, error_message="quota reached")


@tool()
async def structured(ctx: ToolContext, args: Nothing) -> dict[str, object]:
    """Return structured data and use every write-back channel."""
    ctx.send_file("report.csv", b"a,b\n1,2\n")
    ctx.inject_tool("follow_up", "Ask a follow-up question.", {"type": "object"})
    ctx.send_rich_message("card", {"title": "Done", "items": [1, 2]})
    return {"success": True, "rows": 2}


CANCELLED = asyncio.Event()
STARTED = asyncio.Event()


@tool()
async def waits_forever(ctx: ToolContext, args: Nothing) -> str:
    """Wait until cancelled, noting the cancellation."""
    STARTED.set()
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        CANCELLED.set()
        raise
    return "unreachable"


TOOLS = [explode, legacy_failure, legacy_denial, refuses, explicit, structured, waits_forever]


@pytest.fixture
async def stub(make_server) -> AsyncIterator[tool_service_pb2_grpc.ToolServiceStub]:
    server = await make_server(registry=Registry(spec_of(t) for t in TOOLS))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield tool_service_pb2_grpc.ToolServiceStub(channel)


async def test_exception_becomes_error_without_traceback(stub) -> None:
    events = await run_tool(stub, "explode", {})

    result = events[-1].result
    assert result.outcome == events_pb2.OUTCOME_ERROR
    assert result.error.code == "TOOL_EXCEPTION"
    assert phases(events) == ["START s0", "START s1", "END s1 ERROR", "END s0 ERROR",
                          "RESULT ERROR"]
    everything = "".join(str(e) for e in events)
    assert "hunter2" not in everything and "Traceback" not in everything


async def test_legacy_dicts_are_classified(stub) -> None:
    failed = (await run_tool(stub, "legacy_failure", {}))[-1].result
    denied = (await run_tool(stub, "legacy_denial", {}))[-1].result
    raised = (await run_tool(stub, "refuses", {}))[-1].result
    explicit_result = (await run_tool(stub, "explicit", {}))[-1].result

    assert failed.outcome == events_pb2.OUTCOME_FAILED
    assert failed.error.message == "the upstream service timed out"
    assert denied.outcome == events_pb2.OUTCOME_DENIED
    assert raised.outcome == events_pb2.OUTCOME_DENIED
    assert raised.error.message == "not authorized to read that mailbox"
    assert explicit_result.outcome == events_pb2.OUTCOME_FAILED
    assert explicit_result.output == "half done"


async def test_writeback_channels_and_structured_output(stub) -> None:
    result = (await run_tool(stub, "structured", {}))[-1].result

    assert result.outcome == events_pb2.OUTCOME_OK
    assert result.structured_output.struct_value["rows"] == 2
    sent = result.writeback.sent_files[0]
    assert (sent.name, sent.mime_type, sent.size, sent.content) == (
    "report.csv", "text/csv", 8, b"a,b\n1,2\n")
    assert len(sent.sha256) == 64
    assert result.writeback.injected_tools[0].name == "follow_up"
    assert result.writeback.sent_rich_messages[0].payload["title"] == "Done"


async def test_client_cancel_reaches_the_tool(stub) -> None:
    STARTED.clear()
    CANCELLED.clear()
    call = stub.Execute(tool_service_pb2.ExecuteRequest(tool_name="waits_forever"))
    await call.read()
    await asyncio.wait_for(STARTED.wait(), 10)
    call.cancel()
    # Bounded, not timed: a cancel that never reached the tool would wait forever.
    await asyncio.wait_for(CANCELLED.wait(), 20)
    events = await run_tool(stub, "legacy_failure", {})
    assert events[-1].HasField("result")


RELEASE = asyncio.Event()


@tool()
async def stubborn(ctx: ToolContext, args: Nothing) -> str:
    """Swallow every cancellation until released."""
    STARTED.set()
    while not RELEASE.is_set():
        try:
            await RELEASE.wait()
        except asyncio.CancelledError:
            continue
    return "released"


TOOLS.append(stubborn)


async def test_a_tool_that_swallows_cancellation_does_not_hold_its_run(stub) -> None:
    STARTED.clear()
    RELEASE.clear()
    try:
        call = stub.Execute(tool_service_pb2.ExecuteRequest(tool_name="stubborn"))
        first = await call.read()
        await asyncio.wait_for(STARTED.wait(), 10)
        reply = await stub.CancelRun(tool_service_pb2.CancelRunRequest(
            run_id=first.event.run_id, reason="enough"))
        assert reply.cancelled
        events = []
        while (response := await asyncio.wait_for(call.read(), 10)) is not grpc.aio.EOF:
            events.append(response.event)
    finally:
        RELEASE.set()  # let the stubborn task end, or the event loop cannot close
    assert events[-1].result.outcome == events_pb2.OUTCOME_CANCELLED
    assert events[-1].result.error.message == "enough"


@tool()
async def exits(ctx: ToolContext, args: Nothing) -> str:
    """Raise SystemExit, as a tool calling sys.exit() would."""
    async with ctx.step("about to exit"):
        raise SystemExit(3)


@tool()
async def interrupts(ctx: ToolContext, args: Nothing) -> str:
    """Raise KeyboardInterrupt."""
    raise KeyboardInterrupt


@tool()
async def generator_exit(ctx: ToolContext, args: Nothing) -> str:
    """Raise GeneratorExit."""
    raise GeneratorExit


@tool()
def exits_in_thread(ctx: object, args: Nothing) -> str:
    """A plain def tool calling sys.exit()."""
    raise SystemExit(4)


@tool()
def stops_iteration(ctx: object, args: Nothing) -> str:
    """A plain def tool whose next() ran dry (a future refuses StopIteration)."""
    raise StopIteration


class ExitingArgs(BaseModel):
    code: int = 0

    @field_validator("code")
    @classmethod
    def _exit(cls, value: int) -> int:
        raise SystemExit(value)


@tool()
async def exits_validating(ctx: ToolContext, args: ExitingArgs) -> str:
    """A tool whose argument model calls sys.exit() while validating."""
    return "unreachable"


TOOLS.extend([exits, interrupts, generator_exit, exits_in_thread, stops_iteration,
              exits_validating])


async def test_an_argument_model_that_exits_fails_the_call_not_the_server(stub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await run_tool(stub, "exits_validating", {"code": 3})

    assert caught.value.code() == grpc.StatusCode.INTERNAL
    after = await run_tool(stub, "explicit", {})
    assert after[-1].result.outcome == events_pb2.OUTCOME_FAILED


@pytest.mark.parametrize("name", ["exits", "interrupts", "generator_exit", "exits_in_thread",
                                  "stops_iteration"])
async def test_a_tool_raising_a_base_exception_fails_its_run_not_the_server(stub, name) -> None:
    # Raised out of the run's task, SystemExit or KeyboardInterrupt would stop the event
    # loop: one call would end the server for everybody.
    events = await asyncio.wait_for(run_tool(stub, name, {}), 20)

    result = events[-1].result
    assert (result.outcome, result.error.code) == (events_pb2.OUTCOME_ERROR, "TOOL_EXCEPTION")
    assert [e for e in events if e.HasField("result")] == [events[-1]]
    assert phases(events)[-2:] == ["END s0 ERROR", "RESULT ERROR"]
    # ... and the server goes on serving.
    after = await run_tool(stub, "explicit", {})
    assert after[-1].result.outcome == events_pb2.OUTCOME_FAILED


#: asyncio's default executor: the server's own thread work (sandboxes, sessions) runs there.
DEFAULT_EXECUTOR_THREADS = min(32, (os.cpu_count() or 1) + 4)
HOGS_RELEASE = threading.Event()
HOGS_IN: list[int] = []
HOGS_ALL_IN = asyncio.Event()
HOGS_LOOP: list[asyncio.AbstractEventLoop] = []


@tool()
def hog(ctx: object, args: Nothing) -> str:
    """A plain def tool that holds its thread until released, whatever happens to its run."""
    loop = HOGS_LOOP[0]
    HOGS_IN.append(1)
    if len(HOGS_IN) > DEFAULT_EXECUTOR_THREADS:
        loop.call_soon_threadsafe(HOGS_ALL_IN.set)
    HOGS_RELEASE.wait(30)
    return "released"


@tool()
def quick(ctx: object, args: Nothing) -> str:
    """A plain def tool that returns at once."""
    return "quick"


TOOLS.extend([hog, quick])


async def test_plain_def_tools_that_never_return_leave_the_others_their_threads(stub) -> None:
    # More plain def tools than asyncio's default executor has threads, each stuck: the
    # next plain def tool (and the server's own thread work) must not wait behind them.
    HOGS_IN.clear()
    HOGS_ALL_IN.clear()
    HOGS_RELEASE.clear()
    HOGS_LOOP[:] = [asyncio.get_running_loop()]
    hogs = [asyncio.ensure_future(run_tool(stub, "hog", {}))
            for _ in range(DEFAULT_EXECUTOR_THREADS + 1)]
    try:
        await asyncio.wait_for(HOGS_ALL_IN.wait(), 20)
        events = await asyncio.wait_for(run_tool(stub, "quick", {}), 10)
        assert events[-1].result.output == "quick"
    finally:
        HOGS_RELEASE.set()
    for events in await asyncio.gather(*hogs):
        assert events[-1].result.output == "released"


@tool()
async def reenters_a_step(ctx: ToolContext, args: Nothing) -> str:
    """Enters one step object twice."""
    step = ctx.step("once")
    async with step:
        pass
    async with step:
        pass
    return "unreachable"


@tool()
async def ends_a_step_twice(ctx: ToolContext, args: Nothing) -> str:
    """Leaves one step twice (by hand)."""
    step = ctx.step("once")
    await step.__aenter__()
    await step.__aexit__(None, None, None)
    await step.__aexit__(None, None, None)
    return "ended twice"


TOOLS.extend([reenters_a_step, ends_a_step_twice])


async def test_a_step_starts_once_and_ends_once(stub) -> None:
    # Entered again, a step's START followed its own END in the stream, under the same id;
    # left twice, the second exit failed the tool.
    events = await run_tool(stub, "reenters_a_step", {})
    assert phases(events) == ["START s0", "START s1", "END s1 COMPLETE", "END s0 ERROR",
                              "RESULT ERROR"]
    assert events[-1].result.error.code == "TOOL_EXCEPTION"

    events = await run_tool(stub, "ends_a_step_twice", {})
    assert phases(events) == ["START s0", "START s1", "END s1 COMPLETE", "END s0 COMPLETE",
                              "RESULT OK"]
    assert events[-1].result.output == "ended twice"
