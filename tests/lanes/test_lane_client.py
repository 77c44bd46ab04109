"""The Python client with lanes: the request fields, and where a queued run waits as a
typed notice."""

from __future__ import annotations

import pytest

from stargrpc import metrics
from stargrpc.client import (
    NO_RETRY,
    AsyncClient,
    CallError,
    LaneQueued,
    Notice,
    Result,
    StepStarted,
)
from tests.lanes.conftest import LaneServer
from tests.lanes.lane_helpers import (
    Holds,
    first_notice,
    hold_request,
    nap_request,
    started,
    stub_for,
)
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


async def test_lane_busy_reaches_the_caller_at_once_not_retried(lane_server: LaneServer,
                                                                holds: Holds) -> None:
    """LANE_BUSY carries RetryInfo (the estimate), but the client's default policy does not
    retry it: the caller's own max_wait_seconds declined that wait."""
    _, channel = await lane_server(tool_lanes={"nap": "slow"})
    stub = stub_for(channel)
    for _ in range(2):  # the lane's history: runs of about 0.3 s
        await collect(stub.Execute(nap_request(0.3), metadata=ALICE))
    running = stub.Execute(hold_request("a"), metadata=ALICE)
    await started(holds, 1)
    queued = stub.Execute(hold_request("b"), metadata=ALICE)
    await first_notice(queued)

    def refused() -> float:
        return metrics.REGISTRY.get_sample_value(
            "stargrpc_lane_refusals_total", {"lane": "slow", "reason": "lane_busy"}) or 0.0

    before = refused()
    client = AsyncClient(channel, metadata=ALICE)  # the default retry policy
    with pytest.raises(CallError) as busy:
        async for _ in client.execute("nap", {"seconds": 0}, max_wait_seconds=0.01):
            pass
    assert busy.value.reason == "LANE_BUSY"
    assert busy.value.retry_delay is not None and busy.value.retry_delay > 0.01
    assert refused() == before + 1  # asked once
    holds.release("a", "b")
    for call in (running, queued):
        await collect(call)
