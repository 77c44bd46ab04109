"""Critic supervision through a real server: runs that progress live on, hung and merely
pinging runs are stopped, the hard cap and the caller's deadline hold, and a stopped run
leaves no child process behind."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import pytest
from pydantic import BaseModel, Field

from stargrpc import ToolContext, tool
from stargrpc.registry import Registry, spec_of
from stargrpc.server.grpc_server import StargrpcServer
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.critic.tools import hangs, impatient
from tests.helpers import phases, run_tool
from tests.procs import serve

WAIT = 30.0  # generous bound on waits for a run to end; never a performance claim
# Upper bound on the loops of the endless test tools, so none can spin forever.
MAX_ITERATIONS = 5000


class Ticks(BaseModel):
    count: int = Field(ge=1, le=1000)
    every: float = Field(gt=0, le=5)


@tool()
async def steady(ctx: ToolContext, args: Ticks) -> str:
    """Slow but steady: one delta per tick."""
    async with ctx.step("working") as step:
        for i in range(args.count):
            await asyncio.sleep(args.every)
            await step.delta(f"tick {i}\n")
    return f"{args.count} ticks"


@tool()
async def climbs(ctx: ToolContext, args: Ticks) -> str:
    """Slow but steady: a heartbeat with a rising progress value per tick, same message."""
    for i in range(args.count):
        await asyncio.sleep(args.every)
        await ctx.heartbeat("climbing", progress=(i + 1) / args.count)
    return "at the top"


@tool()
async def pings(ctx: ToolContext) -> str:
    """Stuck, but heartbeats forever with the same message."""
    for _ in range(MAX_ITERATIONS):
        await ctx.heartbeat("still here")
        await asyncio.sleep(0.05)
    return "unreachable"


@tool()
async def chatty(ctx: ToolContext) -> str:
    """Endless output."""
    for i in range(MAX_ITERATIONS):
        await ctx.delta(f"line {i}\n")
        await asyncio.sleep(0.02)
    return "unreachable"


@tool()
async def spawns(ctx: ToolContext) -> str:
    """Starts a long child process in its own process group, reports its pid, waits for it;
    on cancellation kills the whole group (what a sandboxed tool does)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import time; time.sleep(600)", start_new_session=True)
    try:
        await ctx.delta(f"pid={proc.pid}")
        await proc.wait()
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    return "child exited"


TOOLS = [steady, climbs, hangs, pings, chatty, impatient, spawns]


def registry() -> Registry:
    specs = [spec_of(fn) for fn in TOOLS]
    return Registry(spec for spec in specs if spec is not None)


def connect(server: StargrpcServer) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")


async def execute(make_server: Callable[..., Awaitable[StargrpcServer]], tool_name: str,
                  arguments: dict[str, object] | None = None, **settings: object
                  ) -> list[events_pb2.RunEvent]:
    """Starts a server with ``settings`` and runs one tool to its Result."""
    server = await make_server(registry=registry(), **settings)
    async with connect(server) as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        return await asyncio.wait_for(run_tool(stub, tool_name, arguments or {}), WAIT)


def result_of(events: list[events_pb2.RunEvent]) -> events_pb2.Result:
    assert events[-1].HasField("result")
    return events[-1].result


def time_left(event: events_pb2.RunEvent) -> float:
    return event.critic_time_left.ToNanoseconds() / 1e9


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_progressing_runs_live_well_past_the_soft_timeout(make_server) -> None:
    server = await make_server(registry=registry(), critic_soft_timeout=0.5)
    async with connect(server) as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        by_delta, by_progress = await asyncio.wait_for(asyncio.gather(
            run_tool(stub, "steady", {"count": 15, "every": 0.1}),
            run_tool(stub, "climbs", {"count": 15, "every": 0.1})), WAIT)

    for events in (by_delta, by_progress):
        result = result_of(events)
        assert result.outcome == events_pb2.OUTCOME_OK, result.error
        assert result.duration.ToNanoseconds() > 1e9  # twice the soft timeout
        # Every event tells a UI how long the critic still allows.
        assert all(event.HasField("critic_time_left") for event in events)
        assert all(0 < time_left(event) <= 0.5 for event in events)
    assert result_of(by_delta).output == "15 ticks"
    assert phases(by_delta).count("DELTA s1 'tick 14\\n'") == 1


async def test_hung_tool_is_stopped_with_its_output(make_server) -> None:
    events = await execute(make_server, "hangs", critic_soft_timeout=0.8,
                           critic_hard_timeout=60)

    assert phases(events) == ["START s0", "DELTA s0 'partial output'", "NOTICE",
                              "END s0 ERROR", "RESULT TIMEOUT"]
    notice = events[2].notice
    assert notice.code == "CRITIC_NO_PROGRESS"
    assert notice.message.startswith("no progress for 0.4")
    assert notice.message.endswith("; stopping at 0.8 s")
    end = events[3].step.step
    assert end.status == events_pb2.STEP_STATUS_ERROR
    assert end.summary == "no progress for 0.8 s"
    result = result_of(events)
    assert result.error.code == "CRITIC_NO_PROGRESS"
    assert result.error.message == "no progress for 0.8 s"
    assert result.output == "partial output"
    assert result.duration.ToNanoseconds() >= 0.8e9


async def test_heartbeats_alone_are_not_progress(make_server) -> None:
    events = await execute(make_server, "pings", critic_soft_timeout=0.5)

    result = result_of(events)
    assert result.outcome == events_pb2.OUTCOME_TIMEOUT
    assert result.error.code == "CRITIC_NO_PROGRESS"
    beats = [event for event in events if event.HasField("heartbeat")]
    assert len(beats) >= 3  # the stream was kept alive meanwhile...
    # ...but only the first heartbeat (a new message) counted: the time left shrank.
    lefts = [time_left(beat) for beat in beats[1:]]
    assert lefts == sorted(lefts, reverse=True)
    assert lefts[-1] < lefts[0]


async def test_hard_cap_stops_a_chatty_endless_tool(make_server) -> None:
    events = await execute(make_server, "chatty", critic_soft_timeout=30,
                           critic_hard_timeout=0.6)

    result = result_of(events)
    assert result.outcome == events_pb2.OUTCOME_TIMEOUT
    assert result.error.code == "CRITIC_HARD_TIMEOUT"
    assert result.error.message == "the run reached its 0.6 s cap"
    assert result.output.startswith("line 0\nline 1\n")
    assert "NOTICE" not in phases(events)  # never short of progress


async def test_a_tool_can_shorten_its_soft_timeout(make_server) -> None:
    events = await execute(make_server, "impatient")  # server default: 90 s

    assert result_of(events).error.message == "no progress for 0.4 s"


@pytest.mark.parametrize("idempotency_key", ["", "deadline-test"])
async def test_the_callers_deadline_wins(make_server, idempotency_key: str) -> None:
    server = await make_server(registry=registry(), critic_soft_timeout=60,
                               critic_hard_timeout=600)
    async with connect(server) as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        events: list[events_pb2.RunEvent] = []
        request = tool_service_pb2.ExecuteRequest(tool_name="chatty",
                                                  idempotency_key=idempotency_key)
        with contextlib.suppress(grpc.aio.AioRpcError):
            async for response in stub.Execute(request, timeout=1.0):
                events.append(response.event)
        assert events, "the run started"
        # Whether or not its Result made it before the deadline, the run has ended: its log
        # (read through WatchRun) holds the Result, though the tool would never stop.
        watched = [response.event async for response in stub.WatchRun(
            tool_service_pb2.WatchRunRequest(run_id=events[0].run_id), timeout=WAIT)]

    result = result_of(watched)
    if idempotency_key:
        # A run with a key outlives its stream, so only the critic can have stopped it.
        assert result.outcome == events_pb2.OUTCOME_TIMEOUT
        assert result.error.code == "CLIENT_DEADLINE"
    else:  # the critic, or the stream's cancellation, whichever came first
        assert result.outcome in (events_pb2.OUTCOME_TIMEOUT, events_pb2.OUTCOME_CANCELLED)


@pytest.mark.parametrize("stopper", ["critic", "caller"])
async def test_a_stopped_run_leaves_no_child_process(make_server, stopper: str) -> None:
    server = await make_server(registry=registry(),
                               critic_soft_timeout=0.5 if stopper == "critic" else 60)
    async with connect(server) as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        events: list[events_pb2.RunEvent] = []
        call = stub.Execute(tool_service_pb2.ExecuteRequest(tool_name="spawns"))
        async with asyncio.timeout(WAIT):
            async for response in call:
                event = response.event
                events.append(event)
                if event.HasField("step") and event.step.delta.startswith("pid="):
                    pid = int(event.step.delta.removeprefix("pid="))
                    assert is_alive(pid)
                    if stopper == "caller":
                        await stub.CancelRun(tool_service_pb2.CancelRunRequest(
                            run_id=event.run_id, reason="test"))

    result = result_of(events)
    expected = events_pb2.OUTCOME_TIMEOUT if stopper == "critic" else events_pb2.OUTCOME_CANCELLED
    assert result.outcome == expected
    assert result.output.startswith("pid=")
    # The Result comes only after the tool's cleanup: the child is already gone.
    assert not is_alive(pid)


async def test_other_methods_pass_through(make_server) -> None:
    server = await make_server(registry=registry(), critic_soft_timeout=0.5)
    async with connect(server) as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        listed = await stub.ListTools(tool_service_pb2.ListToolsRequest(), timeout=WAIT)

    assert {tool.name for tool in listed.tools} == {fn.__name__ for fn in TOOLS}


async def test_serve_takes_the_critic_flags_and_environment(tmp_path: Path) -> None:
    with serve(tmp_path, "--critic-soft-timeout", "0.5",
               STARGRPC_CRITIC_HARD_TIMEOUT="60") as server:
        shown = server.wait_for(lambda line: line.get("event") == "settings", WAIT)
        assert shown["critic_soft_timeout"] == 0.5
        assert shown["critic_hard_timeout"] == 60
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = tool_service_pb2_grpc.ToolServiceStub(channel)
            # The bundled sleep heartbeats only every 30 s: no progress in between.
            events = await asyncio.wait_for(
                run_tool(stub, "sleep", {"seconds": 120, "heartbeat_every": 30}), WAIT)

    assert result_of(events).error.message == "no progress for 0.5 s"
