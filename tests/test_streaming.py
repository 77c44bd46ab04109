"""Event streams (stargrpc.server.streaming): responses serialised once, and DELTA coalescing on
request — every byte in order, seqs without gap or overlap, never merged across other
events — through a real server, and on a run log directly for the exact merging rules."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from pydantic import BaseModel, Field
from redis.asyncio import Redis

from stargrpc import ToolContext, tool
from stargrpc.registry import Registry, spec_of
from stargrpc.server.streaming import MAX_COALESCED_BYTES, EventFrame, event_responses
from stargrpc.stores.memory import MemoryRunLog
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.stores.conftest import REDIS_URL

#: Set by the ``burst`` tool once it has emitted everything, by the ``signal`` it was given.
_EMITTED: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)

#: (kind, step id, channel, delta text) of one event, as the tests expect it.
Expected = tuple[str, str, str, str]


class BurstArgs(BaseModel):
    n: int = Field(ge=1, le=100_000)
    signal: str = ""


@tool()
async def burst(ctx: ToolContext, args: BurstArgs) -> str:
    """Streams ``n`` fixed-width deltas on the top-level step; every 97th on "stderr", a
    heartbeat after every 1000th, a nested step with deltas of its own half-way; yields to
    the event loop every 50 deltas, as a tool doing real work would."""
    for i in range(1, args.n + 1):
        await ctx.delta(f"{i:07d}\n", channel="stderr" if i % 97 == 0 else "")
        if i % 1000 == 0:
            await ctx.heartbeat("still going")
        if i == args.n // 2:
            async with ctx.step("nested") as step:
                for _ in range(3):
                    await step.delta("nested\n")
        if i % 50 == 0:
            await asyncio.sleep(0)
    _EMITTED[args.signal].set()
    return "done"


def expected_events(n: int) -> list[Expected]:
    """What ``burst(n)`` emits, in seq order (seq 1 first)."""
    events: list[Expected] = [("START", "s0", "", "")]
    for i in range(1, n + 1):
        events.append(("DELTA", "s0", "stderr" if i % 97 == 0 else "", f"{i:07d}\n"))
        if i % 1000 == 0:
            events.append(("HEARTBEAT", "", "", ""))
        if i == n // 2:
            events += [("START", "s1", "", ""), *[("DELTA", "s1", "", "nested\n")] * 3,
                       ("END", "s1", "", "")]
    return [*events, ("END", "s0", "", ""), ("RESULT", "", "", "")]


def shape(event: events_pb2.RunEvent) -> Expected:
    kind = event.WhichOneof("kind") or ""
    if kind != "step":
        return (kind.upper(), "", "", "")
    phase = events_pb2.StepPhase.Name(event.step.phase).removeprefix("STEP_PHASE_")
    return (phase, event.step.step.id, event.step.channel, event.step.delta)


def check_stream(received: list[events_pb2.RunEvent], expected: list[Expected]) -> None:
    """Every event exactly once and in order: the messages' seq ranges tile 1..N, each
    merged message stands for DELTAs of one step and channel whose texts it joins in order,
    and every other message is the event itself."""
    covered: list[int] = []
    for event in received:
        first = event.first_seq or event.seq
        seqs = list(range(first, event.seq + 1))
        covered += seqs
        stood_for = [expected[seq - 1] for seq in seqs]
        if event.first_seq:
            assert len(seqs) > 1
            assert {item[:3] for item in stood_for} == {shape(event)[:3]}
            assert stood_for[0][0] == "DELTA"
            assert event.step.delta == "".join(item[3] for item in stood_for)
        else:
            assert [shape(event)] == stood_for
    assert covered == list(range(1, len(expected) + 1))


def request(n: int, *, coalesce: bool, signal: str = "") -> tool_service_pb2.ExecuteRequest:
    return tool_service_pb2.ExecuteRequest(
        tool_name="burst", arguments_json=json.dumps({"n": n, "signal": signal}),
        coalesce_deltas=coalesce)


async def read_all(call: Any) -> list[events_pb2.RunEvent]:
    events = []
    while (response := await call.read()) is not grpc.aio.EOF:
        events.append(response.event)
    return events


@pytest.fixture
async def stub(make_server: Any) -> AsyncIterator[tool_service_pb2_grpc.ToolServiceStub]:
    """A stub of a server (the configured interceptor chain) with the ``burst`` tool."""
    server = await make_server(registry=Registry([spec_of(burst)]))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield tool_service_pb2_grpc.ToolServiceStub(channel)


async def read_behind(stub: tool_service_pb2_grpc.ToolServiceStub, n: int, *, coalesce: bool
                      ) -> list[events_pb2.RunEvent]:
    """Executes ``burst(n)`` with a reader that stops after the first event until the tool
    has emitted everything, so the stream falls behind the run as it does behind a reader
    slower than the tool; then reads the rest."""
    signal = uuid.uuid4().hex
    call = stub.Execute(request(n, coalesce=coalesce, signal=signal))
    first = (await call.read()).event
    await asyncio.wait_for(_EMITTED[signal].wait(), timeout=60)
    return [first, *await read_all(call)]


async def test_a_slow_reader_with_coalescing_gets_every_byte_in_fewer_messages(stub: Any
                                                                              ) -> None:
    n = 20_000
    received = await read_behind(stub, n, coalesce=True)

    expected = expected_events(n)
    check_stream(received, expected)
    assert len(received) < len(expected) // 10
    assert received[-1].result.outcome == events_pb2.OUTCOME_OK
    deltas = "".join(e.step.delta for e in received if e.step.step.id == "s0")
    assert deltas == "".join(f"{i:07d}\n" for i in range(1, n + 1))


async def test_without_coalescing_every_event_is_its_own_message(stub: Any) -> None:
    n = 2_000
    received = await read_behind(stub, n, coalesce=False)
    replayed = await read_all(stub.WatchRun(
        tool_service_pb2.WatchRunRequest(run_id=received[0].run_id)))

    expected = expected_events(n)
    for stream in (received, replayed):
        assert [e.seq for e in stream] == list(range(1, len(expected) + 1))
        assert [shape(e) for e in stream] == expected
        assert not any(e.first_seq for e in stream)
    assert [e.SerializeToString() for e in replayed] == \
        [e.SerializeToString() for e in received]


async def test_watch_run_coalesces_a_replay_and_resumes_after_a_merged_message(stub: Any
                                                                              ) -> None:
    n = 3_000
    executed = await read_all(stub.Execute(request(n, coalesce=False)))

    def watch(after_seq: int) -> Any:
        return stub.WatchRun(tool_service_pb2.WatchRunRequest(
            run_id=executed[0].run_id, after_seq=after_seq, coalesce_deltas=True))

    replayed = await read_all(watch(0))
    merged = next(e for e in replayed if e.first_seq)
    resumed = await read_all(watch(merged.seq))

    expected = expected_events(n)
    check_stream(replayed, expected)
    assert len(replayed) < len(executed) // 10
    assert resumed[0].seq > merged.seq
    check_stream(replayed[:replayed.index(merged) + 1] + resumed, expected)


async def test_a_run_on_another_replica_is_watched_with_its_deltas_merged(make_server: Any
                                                                          ) -> None:
    # Replica B reads the finished run from Redis in batches and merges waiting DELTAs as
    # the replica running it would; every event arrives once, in order, byte for byte.
    prefix = f"stargrpc-test:{uuid.uuid4().hex[:12]}:"
    registry = Registry([spec_of(burst)])
    servers = [await make_server(registry=registry, redis_url=REDIS_URL,
                                 redis_key_prefix=prefix) for _ in range(2)]
    n = 500
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{servers[0].port}") as on_a, \
                grpc.aio.insecure_channel(f"127.0.0.1:{servers[1].port}") as on_b:
            executed = await read_all(tool_service_pb2_grpc.ToolServiceStub(on_a).Execute(
                request(n, coalesce=False)))
            watched = await read_all(tool_service_pb2_grpc.ToolServiceStub(on_b).WatchRun(
                tool_service_pb2.WatchRunRequest(run_id=executed[0].run_id,
                                                 coalesce_deltas=True)))
    finally:
        redis = Redis.from_url(REDIS_URL)
        keys = [k async for k in redis.scan_iter(f"{prefix}*")]
        if keys:
            await redis.delete(*keys)
        await redis.aclose()

    check_stream(watched, expected_events(n))
    assert any(e.first_seq for e in watched)
    by_seq = {e.seq: e.SerializeToString() for e in executed}
    assert all(e.SerializeToString() == by_seq[e.seq] for e in watched if not e.first_seq)


# -- the merging rules, on a run log directly --------------------------------------------

def delta(step_id: str, text: str, channel: str = "") -> events_pb2.RunEvent:
    event = events_pb2.RunEvent()
    event.step.phase = events_pb2.STEP_PHASE_DELTA
    event.step.step.id = step_id
    event.step.delta = text
    event.step.channel = channel
    return event


async def responses_of(log: MemoryRunLog, *, coalesce: bool) -> list[Any]:
    return [r async for r in event_responses(log, 0, tool_service_pb2.ExecuteResponse,
                                             coalesce=coalesce)]


async def test_merged_text_stays_within_the_cap_and_a_big_delta_goes_alone() -> None:
    log = MemoryRunLog("r1")
    small = "é" * 1000  # 2,000 bytes of UTF-8 each
    big = "x" * (MAX_COALESCED_BYTES + 1)
    for text in [small] * 100 + [big] + [small] * 3:
        log.append_nowait(delta("s0", text))
    log.append_nowait(events_pb2.RunEvent(result=events_pb2.Result()))

    responses = await responses_of(log, coalesce=True)

    frames = [r for r in responses if isinstance(r, EventFrame)]
    texts = [f.event.step.delta for f in frames]
    assert "".join(texts) == small * 100 + big + small * 3
    assert all(len(t.encode()) <= MAX_COALESCED_BYTES for t in texts if t != big)
    assert big in texts
    assert sum(f.events for f in frames) == 104
    assert len(frames) == 6  # 32, 32, 32 and 4 small ones (64,000 bytes at most), big, 3
    assert isinstance(responses[-1], tool_service_pb2.ExecuteResponse)  # the Result, as is


async def test_deltas_merge_only_within_one_step_and_channel_between_other_events() -> None:
    log = MemoryRunLog("r2")
    heartbeat = events_pb2.RunEvent()
    heartbeat.heartbeat.message = "tick"
    for event in [delta("s0", "a"), delta("s0", "b"), delta("s0", "c", "stderr"),
                  delta("s0", "d", "stderr"), delta("s1", "e", "stderr"), heartbeat,
                  delta("s1", "f", "stderr"), delta("s1", "g", "stderr")]:
        log.append_nowait(event)
    log.append_nowait(events_pb2.RunEvent(result=events_pb2.Result()))

    coalesced = await responses_of(log, coalesce=True)
    one_each = await responses_of(log, coalesce=False)

    assert [(r.event.first_seq, r.event.seq, r.event.step.delta) for r in coalesced] == [
        (1, 2, "ab"), (3, 4, "cd"), (0, 5, "e"), (0, 6, ""), (7, 8, "fg"), (0, 9, "")]
    assert [r.event.seq for r in one_each] == list(range(1, 10))


async def test_frames_are_the_bytes_of_the_response_messages() -> None:
    log = MemoryRunLog("r3")
    for event in [delta("s0", "a"), delta("s0", "b"), delta("s1", "y" * 300)]:
        log.append_nowait(event)
    log.append_nowait(events_pb2.RunEvent(result=events_pb2.Result(output="ok")))
    merged, large, result = await responses_of(log, coalesce=True)
    single = (await responses_of(log, coalesce=False))[0]

    for frame in (single, merged, large):  # one-byte and longer lengths
        assert frame.data == tool_service_pb2.ExecuteResponse(event=frame.event) \
            .SerializeToString()
        assert tool_service_pb2.WatchRunResponse.FromString(frame.data).event == frame.event
    assert log.encoded(1) == single.event.SerializeToString()
    assert result.event.result.output == "ok"


@tool()
async def hog(ctx: ToolContext, args: BurstArgs) -> str:
    """Streams ``n`` deltas without awaiting anything else in between."""
    for _ in range(args.n):
        await ctx.delta("x")
    _EMITTED[args.signal].set()
    return "done"


@tool()
async def quick(ctx: ToolContext) -> str:
    """Answers at once."""
    return "quick"


async def test_a_tool_streaming_without_pause_does_not_hold_up_other_calls(
        make_server: Any) -> None:
    server = await make_server(registry=Registry([spec_of(hog), spec_of(quick)]))
    signal = uuid.uuid4().hex
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        hogging = stub.Execute(tool_service_pb2.ExecuteRequest(
            tool_name="hog", arguments_json=json.dumps({"n": 100_000, "signal": signal})))
        first = await hogging.read()
        assert first.event.step.phase == events_pb2.STEP_PHASE_START

        answer = [response async for response in stub.Execute(
            tool_service_pb2.ExecuteRequest(tool_name="quick"))]

        # Answered while the other tool was still streaming, not after it.
        assert answer[-1].event.result.output == "quick"
        assert not _EMITTED[signal].is_set()
        hogging.cancel()


#: Released by the test: the ``pausing`` tool waits for it after its first deltas.
_RELEASE: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)


@tool()
async def pausing(ctx: ToolContext, args: BurstArgs) -> str:
    """``n`` deltas without ever giving the loop a turn, then a wait for the test, then one
    delta more: its call reads the first events straight from the log, the rest by
    following it."""
    for i in range(args.n):
        await ctx.delta(f"{i}\n")
    await _RELEASE[args.signal].wait()
    await ctx.delta("after\n")
    return "done"


@pytest.mark.parametrize("coalesce", [False, True])
async def test_a_run_that_waits_after_its_first_events_streams_them_once_then_the_rest(
        make_server: Any, coalesce: bool) -> None:
    server = await make_server(registry=Registry([spec_of(pausing)]))
    signal = uuid.uuid4().hex
    first_texts = "".join(f"{i}\n" for i in range(5))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        call = stub.Execute(tool_service_pb2.ExecuteRequest(
            tool_name="pausing", arguments_json=json.dumps({"n": 5, "signal": signal}),
            coalesce_deltas=coalesce))
        received: list[events_pb2.RunEvent] = []
        while "".join(event.step.delta for event in received) != first_texts:
            received.append((await asyncio.wait_for(call.read(), timeout=30)).event)
        _RELEASE[signal].set()
        received += await read_all(call)
    # Every event once and in order, whichever way each part of the run was read.
    check_stream(received, [("START", "s0", "", ""),
                            *[("DELTA", "s0", "", f"{i}\n") for i in range(5)],
                            ("DELTA", "s0", "", "after\n"), ("END", "s0", "", ""),
                            ("RESULT", "", "", "")])
