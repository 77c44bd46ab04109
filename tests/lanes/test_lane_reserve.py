"""A replica's reserve in a fleet's lane (slots it leases ahead and hands out with no round
trip to Redis, :mod:`stargrpc.stores.redis.lanes`): the lane's capacity stays exact with
reserves held, a run that queues on another replica gets the unused reserve, and a replica
killed with a reserve frees it within its lease."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import grpc
import pytest
from redis.asyncio import Redis

from stargrpc.server.grpc_server import StargrpcServer
from stargrpc.stores.redis import RedisRunStore
from stargrpc.stores.redis.lanes import RESERVE_MAX, RedisLanes
from stargrpc.stores.redis.shared import Shared
from stargrpc.v1 import events_pb2, tool_service_pb2
from tests.helpers import eventually
from tests.lanes.conftest import REDIS_URL, LaneServer
from tests.lanes.lane_helpers import (
    Holds,
    doomed_replica,
    first_notice,
    hold_request,
    no_slot_held,
    started,
    stub_for,
)
from tests.runs_support import as_principal, collect

ALICE = as_principal("alice")
BOB = as_principal("bob")
#: A lane wide enough for reserves (a replica takes one while 4x its size stay free).
WIDE = 40


def _lanes(server: StargrpcServer) -> RedisLanes:
    lanes = server.runtime.lanes
    assert isinstance(lanes, RedisLanes)
    return lanes


def _shared(server: StargrpcServer) -> Shared:
    store = server.runtime.store
    assert isinstance(store, RedisRunStore)
    return store.shared


async def _slots(server: StargrpcServer) -> list[str]:
    """The lane ``slow``'s slots in Redis (run ids and reserve slots "~replica:n")."""
    held = await _shared(server).redis.zrange(_lanes(server).keys("slow")[0], 0, -1)
    return [slot.decode() for slot in held]


def _quick() -> tool_service_pb2.ExecuteRequest:
    return tool_service_pb2.ExecuteRequest(tool_name="quick")


async def test_a_reserve_keeps_the_lane_exact_and_goes_to_runs_queued_on_another_replica(
        fleet: LaneServer, holds: Holds, monkeypatch: pytest.MonkeyPatch) -> None:
    lanes = {"slow": {"max_concurrent": WIDE, "max_queued": 100}}
    server_a, channel_a = await fleet(lanes=lanes, tool_lanes={"quick": "slow"})
    server_b, channel_b = await fleet(lanes=lanes, tool_lanes={"quick": "slow"})
    a, b = stub_for(channel_a), stub_for(channel_b)

    # A run through Redis takes a reserve too: the lane is empty.
    assert (await collect(a.Execute(_quick(), metadata=ALICE)))[-1].result.outcome == \
        events_pb2.OUTCOME_OK
    reserve = _lanes(server_a).reserve("slow")
    assert len(reserve) == RESERVE_MAX
    assert reserve <= set(await _slots(server_a))

    # The next runs on that replica take a reserve slot and give it back: no script.
    scripts = _shared(server_a).scripts
    sent: list[Any] = []
    call = scripts.call

    async def counted(script: Any, keys: list[str], args: list[Any]) -> Any:
        sent.append(script)
        return await call(script, keys, args)

    monkeypatch.setattr(scripts, "call", counted)
    for _ in range(3):
        events = await collect(a.Execute(_quick(), metadata=ALICE))
        assert events[-1].result.outcome == events_pb2.OUTCOME_OK
    assert sent == []

    # Replica b fills the lane: once it queues, replica a gives its unused reserve back to
    # the queue, so all of the lane's slots run b's calls, and not one more.
    calls = [b.Execute(hold_request(f"h{i}"), metadata=BOB) for i in range(WIDE)]
    await asyncio.wait_for(started(holds, WIDE), 60)
    assert len(await _slots(server_b)) == WIDE
    # The lane is full: a call on either replica queues (a's reserve is not used meanwhile),
    # in priority and turn order across replicas.
    late_a = a.Execute(_quick(), metadata=ALICE)
    assert (await first_notice(late_a)).queued.position == 1
    late_b = b.Execute(hold_request("late"), metadata=BOB)
    assert (await first_notice(late_b)).queued.position == 2
    urgent = a.Execute(hold_request("urgent", priority=3), metadata=ALICE)
    assert (await first_notice(urgent)).queued.position == 1
    assert len(holds.started) == WIDE
    assert len(await _slots(server_b)) == WIDE

    # A slot freed goes to the head of the queue, whatever replica it waits on.
    holds.release("h0")
    assert (await collect(calls[0]))[-1].result.outcome == events_pb2.OUTCOME_OK
    assert (await started(holds, WIDE + 1))[-1] == "urgent"
    holds.release("h1")
    assert (await collect(late_a))[-1].result.outcome == events_pb2.OUTCOME_OK
    holds.release(*(f"h{i}" for i in range(2, WIDE)), "late", "urgent")
    assert (await started(holds, WIDE + 2))[-1] == "late"
    for done in [*calls[1:], late_b, urgent]:
        assert (await collect(done))[-1].result.outcome == events_pb2.OUTCOME_OK
    assert len(holds.started) == WIDE + 2
    assert len(await _slots(server_a)) <= WIDE


async def test_an_idle_reserve_is_given_back(lane_server: LaneServer, redis_prefix: str
                                             ) -> None:
    server, channel = await lane_server(
        {"slow": {"max_concurrent": WIDE}}, tool_lanes={"quick": "slow"},
        redis_url=REDIS_URL, redis_key_prefix=redis_prefix, run_lease_seconds=1.0)
    events = await collect(stub_for(channel).Execute(_quick(), metadata=ALICE))
    assert events[-1].result.outcome == events_pb2.OUTCOME_OK
    reserve = _lanes(server).reserve("slow")
    assert len(reserve) == RESERVE_MAX
    assert reserve <= set(await _slots(server))
    # Unused for a lease: back to the lane (and the replica stops renewing it).
    await eventually(lambda: _no_slots(server), within=20, interval=0.05,
                     what="the unused reserve given back")
    assert not _lanes(server).reserve("slow")


async def _no_slots(server: StargrpcServer) -> bool:
    return not await _slots(server)


async def test_a_killed_replica_frees_its_reserve_within_its_lease(
        redis_prefix: str, tmp_path: Path) -> None:
    lanes = {"wide": {"max_concurrent": WIDE}}
    lease = 2.0
    doomed = doomed_replica(tmp_path / "doomed", redis_prefix, lease, lanes, {"tally": "wide"})
    redis = Redis.from_url(REDIS_URL)
    slots = f"{redis_prefix}lane:wide:slots"
    opened = tmp_path / "open"
    opened.touch()
    try:
        async with grpc.aio.insecure_channel(doomed.target) as channel:
            request = tool_service_pb2.ExecuteRequest(tool_name="tally")
            request.arguments_json = json.dumps({"path": str(tmp_path / "tally"),
                                                 "gate": str(opened)})
            events = await collect(stub_for(channel).Execute(request))
            assert events[-1].result.outcome == events_pb2.OUTCOME_OK
        # Its reserve, renewed while it lives (the run's own slot given back meanwhile).
        await eventually(lambda: _count_is(redis, slots, RESERVE_MAX), within=20,
                         interval=0.05, what="the doomed replica's reserve alone")
        doomed.proc.kill()  # SIGKILL: nothing is given back on the way out
        doomed.proc.wait(10)
        await eventually(lambda: no_slot_held(redis, slots), within=10 * lease,
                         interval=0.05, what="the dead replica's reserve lapsed")
    finally:
        doomed.stop()
        await redis.aclose()


async def _count_is(redis: Redis, slots: str, count: int) -> bool:
    return bool(await redis.zcard(slots) == count)


async def test_a_reserve_slot_whose_lease_lapsed_is_dropped(lane_server: LaneServer,
                                                            redis_prefix: str) -> None:
    server, channel = await lane_server(
        {"slow": {"max_concurrent": WIDE}}, tool_lanes={"quick": "slow"},
        redis_url=REDIS_URL, redis_key_prefix=redis_prefix)
    stub = stub_for(channel)
    assert (await collect(stub.Execute(_quick(), metadata=ALICE)))[-1].result.outcome == \
        events_pb2.OUTCOME_OK
    lanes = _lanes(server)
    lapsed = sorted(lanes.reserve("slow"))[0]
    # As after a stall longer than a lease: the slot's lease ran out (another replica may
    # hold it by now), so the replica must not hand it out any more.
    await _shared(server).redis.zadd(lanes.keys("slow")[0], {lapsed: 0}, xx=True)
    await eventually(lambda: lapsed not in lanes.reserve("slow"), within=20,
                     what="the lapsed slot dropped from the reserve")
    assert len(lanes.reserve("slow")) == RESERVE_MAX - 1
    for _ in range(RESERVE_MAX):
        events = await collect(stub.Execute(_quick(), metadata=ALICE))
        assert events[-1].result.outcome == events_pb2.OUTCOME_OK
    assert lapsed not in await _slots(server)
