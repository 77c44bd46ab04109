"""The Python client with lanes: the request fields, and where a queued run waits as a
typed notice."""

from __future__ import annotations

from stargrpc.client import NO_RETRY, AsyncClient, LaneQueued, Notice, Result, StepStarted
from tests.lanes.conftest import LaneServer
from tests.lanes.lane_helpers import Holds, hold_request, started, stub_for
from tests.runs_support import as_principal, collect

ALICE = as_principal("alice")


async def test_a_queued_call_yields_queued_notices_then_its_steps(lane_server: LaneServer,
                                                                 holds: Holds) -> None:
    _, channel = await lane_server()
    first = stub_for(channel).Execute(hold_request("a"), metadata=ALICE)
    await started(holds, 1)
    client = AsyncClient(channel, metadata=ALICE, retry=NO_RETRY)
    events = client.execute("hold", {"name": "b"}, priority=2, max_wait_seconds=60)
    notice = await anext(events)
    assert isinstance(notice, Notice) and notice.code == "QUEUED"
    assert notice.queued == LaneQueued(lane="slow", position=1, estimated_wait=0.0,
                                       priority=2)
    holds.release("a", "b")
    await collect(first)
    rest = [event async for event in events]
    assert isinstance(rest[0], StepStarted)
    assert isinstance(rest[-1], Result) and rest[-1].outcome.name == "OK"
