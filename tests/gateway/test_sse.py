"""The SSE body generator on its own: keep-alive comments while a run is quiet, the events
with their seq as id, the end after the Result, and an early end when the server closes."""

from __future__ import annotations

import asyncio

from stargrpc.gateway.client import StartedRun
from stargrpc.gateway.sse import QueueSource, sse_stream
from stargrpc.v1 import events_pb2


def started_run() -> StartedRun:
    first = events_pb2.RunEvent(run_id="r1", seq=1)
    first.step.phase = events_pb2.STEP_PHASE_START
    return StartedRun(run_id="r1", first=first,
                      result=asyncio.get_running_loop().create_future(),
                      events=asyncio.Queue())


async def test_quiet_runs_get_keep_alive_comments_then_events_until_the_result() -> None:
    run = started_run()
    assert run.events is not None
    body = sse_stream(QueueSource(run), asyncio.Event(), ping_seconds=0.01)

    first = await anext(body)
    ping = await anext(body)  # nothing queued: the stream says it is alive
    run.events.put_nowait(events_pb2.RunEvent(run_id="r1", seq=2,
                                              result=events_pb2.Result(output="done")))
    chunks = [chunk async for chunk in body if not chunk.startswith(b":")]

    assert first.startswith(b"id: 1\nevent: step\ndata: {")
    assert b"retry: 1000\n" in first
    assert ping == b": keep-alive\n\n"
    assert len(chunks) == 1 and chunks[0].startswith(b"id: 2\nevent: result\n")
    assert b'"output":"done"' in chunks[0]


async def test_closing_ends_the_stream_and_detaches_the_listener() -> None:
    run = started_run()
    closing = asyncio.Event()
    body = sse_stream(QueueSource(run), closing, ping_seconds=30)

    await anext(body)
    closing.set()
    rest = [chunk async for chunk in body]

    assert rest == []
    assert run.events is None  # the run's reader stops queueing for a listener that left
