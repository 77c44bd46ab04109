"""A run that waits at an earlier gate (a person's approval) enters its lane only when it
gets to the lane's gate: meanwhile it holds no slot and no place, and a full lane then ends
it ``Result{FAILED, LANE_FULL}``."""

from __future__ import annotations

import asyncio
from typing import Any

from stargrpc.principal import Principal
from stargrpc.runs.run import Run
from stargrpc.runs.runtime import RunRequest, Runtime
from stargrpc.settings import Settings
from stargrpc.v1 import events_pb2
from tests.lanes.lane_helpers import Holds, lane_registry, lane_settings, started


class Approvals(Runtime):
    """A runtime whose runs first wait for their name to be approved (as approval would)."""

    approved: dict[str, asyncio.Event]

    def _prepare(self, request: RunRequest, principal: Principal, *rest: Any) -> Run:
        run = super()._prepare(request, principal, *rest)
        approved = self.approved.setdefault(request.arguments["name"], asyncio.Event())

        async def approval(_: Run) -> None:
            await approved.wait()

        run.gates = [approval]
        return run


def runtime(**lanes: Any) -> Approvals:
    made = Approvals(lane_registry(), settings=Settings(**lane_settings(**lanes)))
    made.approved = {}
    return made


async def admitted(runtime: Runtime, name: str) -> Run:
    admission = await runtime.admit(RunRequest(tool_name="hold", arguments={"name": name}),
                                    Principal("alice"))
    assert admission.run is not None
    return admission.run


async def test_a_run_waiting_for_approval_holds_no_place_in_its_lane(holds: Holds) -> None:
    lanes = runtime(slow={"max_concurrent": 1, "max_queued": 1})
    first = await admitted(lanes, "a")
    lanes.approved["a"].set()
    await started(holds, 1)
    pending = await admitted(lanes, "b")  # waits for its approval: no place taken
    queued = await admitted(lanes, "c")  # the one place in the queue is still free
    lanes.approved["c"].set()
    told = await asyncio.wait_for(anext(aiter(queued.log.follow(0))), 10)
    assert (told.notice.code, told.notice.queued.position) == ("QUEUED", 1)
    assert lanes.lanes.where(queued.run_id) is not None
    assert lanes.lanes.where(pending.run_id) is None

    # Approved while the queue is full: its lane refuses it, as its Result.
    lanes.approved["b"].set()
    refused = await asyncio.wait_for(pending.wait(), 10)
    assert (refused.outcome, refused.error.code) == (events_pb2.OUTCOME_FAILED, "LANE_FULL")
    assert "b" not in holds.started

    holds.release("a", "c")
    for run in (first, queued):
        assert (await asyncio.wait_for(run.wait(), 10)).outcome == events_pb2.OUTCOME_OK
    assert holds.started == ["a", "c"]
