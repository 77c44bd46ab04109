"""Lanes shared by a fleet through Redis (one Redis and a Redis Cluster): capacity, queue,
priority and turns hold across replicas, and a replica that dies frees its slots within its
lease while its queued runs end RUN_LOST."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
from redis.asyncio import Redis

from stargrpc.v1 import events_pb2, tool_service_pb2
from tests.helpers import eventually
from tests.lanes.conftest import REDIS_URL, LaneServer
from tests.lanes.lane_helpers import (
    Holds,
    doomed_replica,
    first_notice,
    hold_request,
    next_event,
    no_slot_held,
    started,
    stub_for,
)
from tests.runs_support import (
    HeaderPrincipal,
    as_principal,
    collect,
    execute_request,
    run_registry,
)

ALICE = as_principal("alice")
BOB = as_principal("bob")
#: Who the runs of a server without authentication belong to.
LOCAL = as_principal("local")


async def test_two_replicas_share_a_lanes_slots_priority_and_turns(fleet: LaneServer,
                                                                  holds: Holds) -> None:
    _, channel_a = await fleet()
    _, channel_b = await fleet()
    a, b = stub_for(channel_a), stub_for(channel_b)
    first = a.Execute(hold_request("a"), metadata=ALICE)
    await started(holds, 1)
    # The slot is taken on replica a: a call on replica b waits for it.
    b1 = b.Execute(hold_request("b1"), metadata=ALICE)
    assert (await first_notice(b1)).queued.position == 1
    b2 = a.Execute(hold_request("b2"), metadata=ALICE)
    assert (await first_notice(b2)).queued.position == 2
    c = b.Execute(hold_request("c"), metadata=BOB)  # bob's first turn: before alice's second
    assert (await first_notice(c)).queued.position == 2
    urgent = a.Execute(hold_request("u", priority=3), metadata=ALICE)
    assert (await first_notice(urgent)).queued.position == 1

    # Any replica lists the runs queued on either, with their place (a replica learns a
    # place of its own that moved at its next look at the lane, within 50 ms).
    expected = [(1, 3, "slow"), (2, 0, "slow"), (4, 0, "slow")]  # alice's u, b1, b2
    seen: list[list[tuple[int, int, str]]] = []

    async def listed_queued() -> bool:
        listed = await a.ListRuns(tool_service_pb2.ListRunsRequest(
            state=tool_service_pb2.RUN_STATE_QUEUED), metadata=ALICE)
        seen.append(sorted((run.queue_position, run.priority, run.lane)
                           for run in listed.runs))
        return seen[-1] == expected

    await eventually(listed_queued, what=lambda: f"alice's queued runs listed: {seen[-1]}")

    order = ["a", "u", "b1", "c", "b2"]
    calls = dict(zip(order, [first, urgent, b1, c, b2], strict=True))
    for i, name in enumerate(order):
        assert (await started(holds, i + 1))[i] == name  # exactly one runs at a time
        holds.release(name)
        assert (await collect(calls[name]))[-1].result.outcome == events_pb2.OUTCOME_OK
    assert holds.started == order


async def test_a_killed_replica_frees_its_slot_and_its_queued_runs_end_run_lost(
        make_server: object, redis_prefix: str, tmp_path: Path) -> None:
    lanes = {"slow": {"max_concurrent": 1, "max_queued": 10}}
    lease = 2.0
    survivor = await make_server(  # type: ignore[operator]
        registry=run_registry(), interceptors=[HeaderPrincipal()], redis_url=REDIS_URL,
        redis_key_prefix=redis_prefix, run_lease_seconds=lease, run_sweep_interval_seconds=0.25,
        lanes=lanes, tool_lanes={"tally": "slow"})
    doomed = doomed_replica(tmp_path / "doomed", redis_prefix, lease, lanes, {"tally": "slow"})
    redis = Redis.from_url(REDIS_URL)
    slots = f"{redis_prefix}lane:slow:slots"
    never = {"path": str(tmp_path / "tally"), "gate": str(tmp_path / "never")}
    opened = tmp_path / "open"
    opened.touch()
    try:
        async with grpc.aio.insecure_channel(doomed.target) as channel:
            stub = stub_for(channel)
            holding = await stub.StartRun(start("tally", never))
            # Another process holds the slot: wait until Redis shows it.
            await eventually(lambda: redis.zcard(slots), within=20, interval=0.05,
                             what="the doomed replica holding the lane's slot")
            queued_there = await stub.StartRun(start("tally", never))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{survivor.port}") as channel:
            stub = stub_for(channel)
            waiting = stub.Execute(execute_request(
                "tally", {"path": str(tmp_path / "tally"), "gate": str(opened)}),
                metadata=ALICE)
            assert (await first_notice(waiting)).queued.position == 2
            # Its QUEUED notice in Redis: the run is known to the fleet (registered).
            await eventually(lambda: redis.exists(f"{redis_prefix}run:{queued_there.run_id}"),
                             within=20, interval=0.05, what="the queued run in Redis")
            doomed.proc.kill()  # SIGKILL: nothing is released on the way out
            doomed.proc.wait(10)
            # Its slot lapses within its lease; the survivor's run gets it and runs.
            start_event = await asyncio.wait_for(next_event(waiting), 6 * lease)
            while not start_event.HasField("step"):
                start_event = await next_event(waiting)
            assert start_event.step.phase == events_pb2.STEP_PHASE_START
            events = await collect(waiting)
            assert events[-1].result.outcome == events_pb2.OUTCOME_OK
            # The dead replica's runs, the queued one too, end RUN_LOST.
            for run_id in (holding.run_id, queued_there.run_id):
                lost = await asyncio.wait_for(collect(stub.WatchRun(
                    tool_service_pb2.WatchRunRequest(run_id=run_id), metadata=LOCAL)),
                    10 * lease)
                assert lost[-1].result.error.code == "RUN_LOST", run_id
        # No slot leaked: the lane is empty again.
        await eventually(lambda: no_slot_held(redis, slots), within=10, interval=0.05,
                         what="the lane's slots all free")
    finally:
        doomed.stop()
        await redis.aclose()


def start(tool: str, arguments: dict[str, str]) -> tool_service_pb2.StartRunRequest:
    request = tool_service_pb2.StartRunRequest(tool_name=tool)
    request.arguments_json = json.dumps(arguments)
    return request
