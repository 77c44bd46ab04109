"""Support for the lane tests: tools whose runs the test ends when it wants (``hold``), a
tool of known duration (``nap``), a server with lanes, and reading QUEUED notices."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
from pydantic import BaseModel, Field
from redis.asyncio import Redis

from stargrpc import ToolContext, tool
from stargrpc.registry import Registry, spec_of
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.procs import ServerProcess, server_env
from tests.runs_support import RUN_TOOLS_DIR
from tests.stores.conftest import REDIS_URL


class Holds:
    """Runs of ``hold`` wait until the test lets their name go; started ones are noted."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self._events: dict[str, asyncio.Event] = {}
        self.changed = asyncio.Event()

    def event(self, name: str) -> asyncio.Event:
        return self._events.setdefault(name, asyncio.Event())

    def release(self, *names: str) -> None:
        for name in names:
            self.event(name).set()


#: The Holds of the test running now (the tools find it here: they run in its server).
HOLDS: list[Holds] = []


class HoldArgs(BaseModel):
    name: str = Field(description="What the test calls this run.")


@tool(kind="test", lane="slow")
async def hold(ctx: ToolContext, args: HoldArgs) -> str:
    """Note the start, then wait until the test releases ``name``."""
    holds = HOLDS[-1]
    holds.started.append(args.name)
    holds.changed.set()
    await holds.event(args.name).wait()
    return f"released {args.name}"


@tool(kind="test", lane="slow", priority=3)
async def hold_urgent(ctx: ToolContext, args: HoldArgs) -> str:
    """``hold`` whose runs default to priority 3."""
    return await hold(ctx, args)


class NapArgs(BaseModel):
    seconds: float = Field(ge=0, le=10)


@tool(kind="test", lane="timed")
async def nap(ctx: ToolContext, args: NapArgs) -> str:
    """Sleep ``seconds``: a run of known duration."""
    await asyncio.sleep(args.seconds)
    return "slept"


class FanArgs(BaseModel):
    children: int = Field(ge=0, le=8)


@tool(kind="test", lane="slow")
async def fan(ctx: ToolContext, args: FanArgs) -> str:
    """Calls itself (in its own lane) ``children`` times at once, one level deep."""
    if args.children:
        await asyncio.gather(*(ctx.call("fan", {"children": 0})
                               for _ in range(args.children)))
    return f"fanned {args.children}"


@tool(kind="test")
async def quick(ctx: ToolContext) -> str:
    """Return at once (the lane tool_lanes gives it)."""
    return "done"


def lane_registry() -> Registry:
    """The lane test tools."""
    return Registry([spec for fn in (hold, hold_urgent, nap, quick)
                     if (spec := spec_of(fn)) is not None])


def fan_registry() -> Registry:
    """The lane test tools and ``fan``, which calls itself in its own lane."""
    tools = lane_registry()
    return Registry([*(tools[name] for name in tools), spec_of(fan)])  # type: ignore[list-item]


def lane_settings(**lanes: dict[str, Any]) -> dict[str, Any]:
    """Server settings with lanes ``slow`` (1 slot) and ``timed`` (1 slot) unless given."""
    configured = {"slow": {"max_concurrent": 1, "max_queued": 100},
                  "timed": {"max_concurrent": 1, "max_queued": 100}, **lanes}
    return {"lanes": configured, "max_concurrent_runs_per_principal": 0,
            "max_concurrent_runs": 0}


def hold_request(name: str, **fields: Any) -> tool_service_pb2.ExecuteRequest:
    request = tool_service_pb2.ExecuteRequest(tool_name=fields.pop("tool_name", "hold"),
                                              **fields)
    request.arguments_json = f'{{"name": "{name}"}}'
    return request


def nap_request(seconds: float, **fields: Any) -> tool_service_pb2.ExecuteRequest:
    request = tool_service_pb2.ExecuteRequest(tool_name="nap", **fields)
    request.arguments_json = f'{{"seconds": {seconds}}}'
    return request


async def next_event(call: Any) -> events_pb2.RunEvent:
    """The next event of an Execute stream."""
    response = await call.read()
    assert response is not grpc.aio.EOF, "the stream ended"
    return response.event


async def first_notice(call: Any) -> events_pb2.Notice:
    """The first event of a queued run's stream: its QUEUED notice."""
    event = await next_event(call)
    assert event.HasField("notice"), event
    assert event.notice.code == "QUEUED", event.notice
    return event.notice


async def started(holds: Holds, count: int) -> list[str]:
    """Waits until ``count`` runs of ``hold`` have started; their names in order."""
    while len(holds.started) < count:
        holds.changed.clear()
        await holds.changed.wait()
    return list(holds.started)


async def events_until_result(call: Any) -> AsyncIterator[events_pb2.RunEvent]:
    """The remaining events of a stream."""
    while (response := await call.read()) is not grpc.aio.EOF:
        yield response.event


def stub_for(channel: grpc.aio.Channel) -> tool_service_pb2_grpc.ToolServiceStub:
    return tool_service_pb2_grpc.ToolServiceStub(channel)


def doomed_replica(folder: Path, prefix: str, lease: float, lanes: dict[str, Any],
                   tool_lanes: dict[str, str]) -> ServerProcess:
    """A replica in a process of its own (the run tools, no auth), for a test to SIGKILL."""
    return ServerProcess(
        ["--tools-dir", str(RUN_TOOLS_DIR), "--redis-url", REDIS_URL],
        server_env(folder, STARGRPC_REDIS_KEY_PREFIX=prefix,
                   STARGRPC_RUN_LEASE_SECONDS=str(lease), STARGRPC_LANES=json.dumps(lanes),
                   STARGRPC_TOOL_LANES=json.dumps(tool_lanes)))


async def no_slot_held(redis: Redis, slots: str) -> bool:
    """No slot held: none whose lease still runs (a lapsed one is free, and dropped by the
    lane's next script)."""
    seconds, micros = await redis.time()
    return await redis.zcount(slots, f"({seconds * 1000 + micros // 1000}", "+inf") == 0
