"""The run store while a Redis Cluster reshards (3 primaries, 3 replicas, on loopback): two
replicas stream runs — keyed calls, long streams watched from the other replica, a run
steered from the other replica — while a quarter of each primary's slots (and every long
run's slot) moves to the next primary, each move held open so that the scripts meet it
(slots MIGRATING with no key moved yet, then a run's events moved and its lease and meta
hash not: Redis answers ASK and TRYAGAIN). Afterwards no event is lost, every run is whole
in its streams and in Redis, watchers resumed mid-move without gap or duplicate, every key
ran its tool once, and the steered run got every message."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from stargrpc.stores.connect import connect
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.runs_support import collect, execute_request, key, stripped
from tests.stores.conftest import LoopbackCluster
from tests.stores.helpers import assert_whole, keyed_call, stored_events, two_replicas

#: Long runs, each started on one replica and watched (and attached to) on the other.
_LONG_RUNS = 6
#: Keyed calls made at once while the slots move (each worker one after the other).
_WORKERS = 8
#: Keyed calls one worker makes at most.
_CALLS_PER_WORKER = 40
#: How long each stage of a move is held open (seconds; below the lease of 5 s).
_HOLD = 0.8


async def _watch_resuming(stub: Any, run_id: str, resume: asyncio.Event
                          ) -> list[events_pb2.RunEvent]:
    """Watches a run, drops the watch after a few events, and — once ``resume`` is set (in
    the middle of a move) — watches again after the last seq it saw."""
    call = stub.WatchRun(tool_service_pb2.WatchRunRequest(run_id=run_id))
    seen: list[events_pb2.RunEvent] = []
    while len(seen) < 10:
        response = await call.read()
        assert response is not grpc.aio.EOF
        seen.append(response.event)
    call.cancel()
    await resume.wait()
    rest = await collect(stub.WatchRun(tool_service_pb2.WatchRunRequest(
        run_id=run_id, after_seq=seen[-1].seq)))
    return seen + rest


async def _attach(stub: Any, request: tool_service_pb2.ExecuteRequest
                  ) -> list[events_pb2.RunEvent]:
    """Execute with the request's idempotency key, sent again while it fails UNAVAILABLE
    before any event (a claim that did not answer within redis_timeout_seconds on a loaded
    machine), as a client does: the key attaches it to the same run."""
    for _ in range(40):
        try:
            return await collect(stub.Execute(request))
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
            await asyncio.sleep(0.1)
    raise AssertionError(f"Execute {request.idempotency_key!r} never attached")


async def _steer(stub: Any, run_id: str, message: str) -> None:
    """SteerRun, sent again (as its RetryInfo says) while it fails UNAVAILABLE: a steer
    refused because the run's slot was moving was not left, so nothing is sent twice."""
    for _ in range(40):
        try:
            await stub.SteerRun(tool_service_pb2.SteerRunRequest(run_id=run_id,
                                                                  message=message))
            return
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
            await asyncio.sleep(0.1)
    raise AssertionError(f"SteerRun {message!r} never went through")


async def test_runs_stream_through_a_resharding_without_loss_gap_or_second_run(
        make_server, redis_cluster: LoopbackCluster, tmp_path: Path) -> None:
    replicas = await two_replicas(make_server, redis_cluster.url, run_lease_seconds=5.0,
                                   redis_timeout_seconds=1.0)
    gate = tmp_path / "gate"  # the keyed calls' tool returns at once
    gate.touch()
    long_gate = tmp_path / "long-gate"  # the long runs heartbeat until the slots have moved
    resume_watchers = asyncio.Event()
    resharded = asyncio.Event()
    moves: list[tuple[int, int, int, int]] = []

    primaries = sorted(redis_cluster.primary_ports())
    moved_slots: set[int] = set()
    run_slots: set[int] = set()  # the long runs' slots, filled in once they started

    def move_quarter(round_: int) -> tuple[int, int, int, int]:
        """Moves a quarter of a primary's slots, and the long runs' slots it serves, to the
        next primary (round by round around the ring; no slot moves twice)."""
        source, target = primaries[round_ % 3], primaries[(round_ + 1) % 3]
        slots = [slot for slot in redis_cluster.slots_of(source) if slot not in moved_slots]
        chosen = sorted(set(slots[:len(slots) // 4]) | (run_slots & set(slots)))
        count = redis_cluster.move_slots(source, target, chosen, hold=_HOLD,
                                         first=lambda name: name.endswith(b":events"))
        moved_slots.update(chosen)
        return source, target, len(chosen), count

    async def reshard() -> None:
        try:
            for round_ in range(3):
                if round_ == 0:  # the watchers come back while these slots are open
                    asyncio.get_running_loop().call_later(_HOLD / 2, resume_watchers.set)
                move = asyncio.ensure_future(asyncio.to_thread(move_quarter, round_))
                await asyncio.sleep(_HOLD / 2)  # into the window the move holds open
                # Steered from B while the slots are open (the listening run's, in one round).
                await _steer(stubs[1], listening_id, f"round {round_}")
                moves.append(await move)
        finally:
            resume_watchers.set()
            resharded.set()
            long_gate.touch()

    async def keyed_worker(worker: int) -> list[tuple[str, list[list[events_pb2.RunEvent]]]]:
        done = []
        for n in range(_CALLS_PER_WORKER):
            if resharded.is_set() and n > 0:
                break
            done.append(await keyed_call(stubs, worker * _CALLS_PER_WORKER + n, tmp_path,
                                          gate))
        return done

    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{r.port}") for r in replicas]
    try:
        stubs = [tool_service_pb2_grpc.ToolServiceStub(channel) for channel in channels]
        requests = [execute_request("chatter", {"count": 2000, "size": 16,
                                                "gate": str(long_gate)},
                                    idempotency_key=key()) for _ in range(_LONG_RUNS)]
        calls = [stubs[i % 2].Execute(request) for i, request in enumerate(requests)]
        firsts = [(await call.read()).event for call in calls]
        # A run on A that waits for three steering messages, left from B, one per move.
        listening = stubs[0].Execute(execute_request("listen", {"count": 3}))
        listening_id = (await listening.read()).event.run_id
        listened = asyncio.ensure_future(collect(listening))
        # The hash tag of a run's keys is its id.
        run_slots.update(key_slot(run_id.encode())
                         for run_id in [listening_id, *(first.run_id for first in firsts)])
        executing = [asyncio.create_task(collect(call)) for call in calls]
        attached = [asyncio.create_task(_attach(stubs[(i + 1) % 2], request))
                    for i, request in enumerate(requests)]
        watching = [asyncio.create_task(_watch_resuming(
            stubs[(i + 1) % 2], first.run_id, resume_watchers))
            for i, first in enumerate(firsts)]
        mover = asyncio.create_task(reshard())
        keyed = await asyncio.wait_for(asyncio.gather(
            *(keyed_worker(w) for w in range(_WORKERS))), 180)
        await asyncio.wait_for(mover, 120)
        steered = await asyncio.wait_for(listened, 60)
        executed = [[first, *await asyncio.wait_for(task, 60)]
                    for first, task in zip(firsts, executing, strict=True)]
        joined = [await asyncio.wait_for(task, 60) for task in attached]
        watched = [await asyncio.wait_for(task, 60) for task in watching]
        # Replayed afterwards from the other replica: the whole run, from Redis.
        replayed = [await collect(stubs[(i + 1) % 2].WatchRun(
            tool_service_pb2.WatchRunRequest(run_id=first.run_id)))
            for i, first in enumerate(firsts)]
    finally:
        for channel in channels:
            await channel.close()
    for replica in replicas:  # every event of theirs in Redis
        assert await replica.runtime.store.flushed(30)
    keyed_calls = [call for worker in keyed for call in worker]
    client, _ = connect(redis_cluster.url, timeout=2.0)
    assert isinstance(client, RedisCluster)
    try:
        stored_long = [await stored_events(client, "stargrpc:", first.run_id) for first in firsts]
        stored_keyed = [await stored_events(client, "stargrpc:", streams[-1][0].run_id)
                        for _, streams in keyed_calls]
    finally:
        await client.aclose()

    assert len(moves) == 3 and sum(count for *_, count in moves) > 0, moves
    assert run_slots <= moved_slots
    assert steered[-1].result.output == "round 0 | round 1 | round 2"
    for events, joined_events, watched_events, replayed_events, in_redis in zip(
            executed, joined, watched, replayed, stored_long, strict=True):
        assert_whole(events)
        assert events[-1].result.outcome == events_pb2.OUTCOME_OK
        assert events[-1].result.output == "sent 2000"
        assert stripped(joined_events) == stripped(events)
        assert stripped(watched_events) == stripped(events)
        assert stripped(replayed_events) == stripped(events)
        assert stripped(in_redis) == stripped(events)
    assert len(keyed_calls) >= _WORKERS
    for tally, streams in keyed_calls:
        for events in streams:
            assert_whole(events)
        final = streams[-1]
        assert final[-1].result.outcome == events_pb2.OUTCOME_OK
        ran = Path(tally).read_text().split()  # noqa: ASYNC240 - after every call ended
        # No primary died: nothing acknowledged was lost, so the tool ran exactly once.
        assert ran == [final[0].run_id], streams
    for (_, streams), in_redis in zip(keyed_calls, stored_keyed, strict=True):
        assert stripped(in_redis) == stripped(streams[-1])
