"""A call that finds its lane full waits in the lane's queue (over gRPC, one server)."""

from __future__ import annotations

from stargrpc.v1 import events_pb2
from tests.lanes.conftest import LaneServer
from tests.lanes.lane_helpers import (
    Holds,
    first_notice,
    hold_request,
    next_event,
    started,
    stub_for,
)
from tests.runs_support import as_principal, collect

ALICE = as_principal("alice")
BOB = as_principal("bob")


async def test_a_full_lane_queues_the_call_tells_its_place_then_starts_it(
        lane_server: LaneServer, holds: Holds) -> None:
    _, channel = await lane_server()
    stub = stub_for(channel)
    first = stub.Execute(hold_request("a"), metadata=ALICE)
    assert (await next_event(first)).step.phase == events_pb2.STEP_PHASE_START
    await started(holds, 1)

    second = stub.Execute(hold_request("b"), metadata=ALICE)
    third = stub.Execute(hold_request("c"), metadata=BOB)
    notice_b = await first_notice(second)
    notice_c = await first_notice(third)
    assert (notice_b.queued.lane, notice_b.queued.position) == ("slow", 1)
    assert (notice_c.queued.lane, notice_c.queued.position) == ("slow", 2)

    holds.release("a")
    assert (await collect(first))[-1].result.outcome == events_pb2.OUTCOME_OK
    # b starts; c moves up to position 1 and is told so.
    assert (await next_event(second)).step.phase == events_pb2.STEP_PHASE_START
    moved = await first_notice(third)
    assert moved.queued.position == 1
    holds.release("b", "c")
    events_b = await collect(second)
    assert events_b[-1].result.outcome == events_pb2.OUTCOME_OK
    assert events_b[-1].result.usage.queued_seconds > 0
    events_c = await collect(third)
    assert events_c[0].step.phase == events_pb2.STEP_PHASE_START
    assert events_c[-1].result.outcome == events_pb2.OUTCOME_OK
    assert await started(holds, 3) == ["a", "b", "c"]


async def test_a_cancelled_queued_call_leaves_the_queue_and_never_runs(
        lane_server: LaneServer, holds: Holds) -> None:
    _, channel = await lane_server()
    stub = stub_for(channel)
    first = stub.Execute(hold_request("a"), metadata=ALICE)
    await started(holds, 1)
    second = stub.Execute(hold_request("b"), metadata=ALICE)
    await first_notice(second)
    second.cancel()
    third = stub.Execute(hold_request("c"), metadata=ALICE)
    notice = await first_notice(third)
    assert notice.queued.position in (1, 2)  # b may still be leaving
    holds.release("a", "c")
    await collect(first)
    events = await collect(third)
    assert events[-1].result.outcome == events_pb2.OUTCOME_OK
    assert "b" not in holds.started
