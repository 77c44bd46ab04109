"""The run store on a real Redis Cluster (3 primaries, 3 replicas, on loopback): every script
touches one slot, two replicas share runs across it, and 500 keyed calls spread over both
replicas survive a primary killed mid-way (every run complete and gapless, at most one body
per key unless its run was lost)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import MovedError

from stargrpc.stores.connect import connect
from stargrpc.stores.redis import NotReplicated, RedisRunStore
from stargrpc.stores.redis.errors import SLOT_MOVING
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.runs_support import (
    collect,
    execute_request,
    key,
    stripped,
)
from tests.stores.conftest import LoopbackCluster
from tests.stores.helpers import (
    assert_whole,
    keyed_call,
    redis_cli,
    stored_events,
    two_replicas,
)


async def test_two_replicas_share_runs_on_a_cluster_each_script_in_one_slot(
        make_server, redis_cluster: LoopbackCluster, tmp_path: Path) -> None:
    a, b = await two_replicas(make_server, redis_cluster.url)
    client, _ = connect(redis_cluster.url, timeout=2.0)
    assert isinstance(client, RedisCluster)
    gate = tmp_path / "gate"
    async with grpc.aio.insecure_channel(f"127.0.0.1:{a.port}") as chan_a, \
            grpc.aio.insecure_channel(f"127.0.0.1:{b.port}") as chan_b:
        stub_a = tool_service_pb2_grpc.ToolServiceStub(chan_a)
        stub_b = tool_service_pb2_grpc.ToolServiceStub(chan_b)
        request = execute_request("tally", {"path": str(tmp_path / "tally"), "gate": str(gate),
                                            "deltas": 3}, idempotency_key=key())
        call = stub_a.Execute(request)
        first = (await call.read()).event
        attached = stub_b.Execute(request)  # the same key on the other replica, meanwhile
        live = stub_b.WatchRun(tool_service_pb2.WatchRunRequest(run_id=first.run_id))
        live_first = (await live.read()).event
        gate.touch()
        executed = [first, *await collect(call)]
        watched = [live_first, *await collect(live)]
        joined = await collect(attached)
        replayed = await collect(stub_b.Execute(request))
        plain = await asyncio.gather(*(collect(stub.Execute(execute_request(
            "echo", {"text": str(i)}))) for i, stub in enumerate([stub_a, stub_b] * 10)))
    try:
        stored = await stored_events(client, "stargrpc:", first.run_id)
        slots = {await client.cluster_keyslot(f"stargrpc:run:{{{first.run_id}}}{part}")
                 for part in ("", ":events", ":lease", ":cancel")}
    finally:
        await client.aclose()

    assert_whole(executed)
    assert executed[-1].result.outcome == events_pb2.OUTCOME_OK
    assert stripped(watched) == stripped(executed)
    assert stripped(joined) == stripped(executed)
    assert stripped(replayed) == stripped(executed)
    assert stripped(stored) == stripped(executed)
    assert (tmp_path / "tally").read_text().split() == [first.run_id]
    assert [events[-1].result.outcome for events in plain] == [events_pb2.OUTCOME_OK] * 20
    assert len(slots) == 1


async def test_500_keyed_calls_across_two_replicas_survive_a_killed_primary(
        make_server, redis_cluster: LoopbackCluster, tmp_path: Path) -> None:
    replicas = await two_replicas(make_server, redis_cluster.url, run_lease_seconds=5.0,
                                   redis_timeout_seconds=1.0)
    gate = tmp_path / "gate"
    gate.touch()
    killed = redis_cluster.primary_ports()[0]
    done = 0
    halfway = asyncio.Event()
    limit = asyncio.Semaphore(24)

    async def one(stubs: list[Any], index: int) -> tuple[str, list[list[events_pb2.RunEvent]]]:
        nonlocal done
        async with limit:
            outcome = await keyed_call(stubs, index, tmp_path, gate)
        done += 1
        if done >= 150:
            halfway.set()
        return outcome

    async def kill_a_primary() -> None:
        await halfway.wait()
        redis_cluster.kill(killed)
        await redis_cluster.await_failover(killed)

    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{r.port}") for r in replicas]
    try:
        stubs = [tool_service_pb2_grpc.ToolServiceStub(channel) for channel in channels]
        killer = asyncio.create_task(kill_a_primary())
        calls = await asyncio.wait_for(asyncio.gather(
            *(one(stubs, i) for i in range(500))), 240)
        await asyncio.wait_for(killer, 60)
        # Watched afterwards from the other replica: the whole run, from Redis.
        watched = [await collect(stubs[1].WatchRun(tool_service_pb2.WatchRunRequest(
            run_id=streams[-1][0].run_id))) for _, streams in calls[::25]]
    finally:
        for channel in channels:
            await channel.close()
    for replica in replicas:  # every event of theirs in Redis
        assert await replica.runtime.store.flushed(30)
    client, _ = connect(redis_cluster.url, timeout=2.0)
    assert isinstance(client, RedisCluster)
    try:
        stored = [await stored_events(client, "stargrpc:", streams[-1][0].run_id)
                  for _, streams in calls]
    finally:
        await client.aclose()

    for (tally, streams), in_redis in zip(calls, stored, strict=True):
        for events in streams:
            assert_whole(events)
        final = streams[-1]
        assert final[-1].result.outcome == events_pb2.OUTCOME_OK
        assert stripped(in_redis) == stripped(final)
        # The body ran once per run that started, and again only after its run was lost.
        ran = Path(tally).read_text().split()  # noqa: ASYNC240 - after every call ended
        assert ran[-1] == final[0].run_id
        lost = {events[0].run_id for events in streams[:-1]}
        assert set(ran[:-1]) <= lost and len(set(ran)) == len(ran)
    for events, (_, streams) in zip(watched, calls[::25], strict=True):
        assert stripped(events) == stripped(streams[-1])
    assert len(calls) == 500


async def test_a_durable_write_redirected_to_another_node_is_not_taken_as_replicated(
        redis_cluster: LoopbackCluster) -> None:
    # A slot moved after the client learnt the slot map: the node it writes to answers
    # MOVED. The node it moved to has lost its replica, so a write there is acknowledged by
    # no replica; the WAIT sent to the old node (which took no write) must not vouch for it.
    client, _ = connect(redis_cluster.url, timeout=2.0)
    assert isinstance(client, RedisCluster)
    store = RedisRunStore(client, prefix="stargrpc:", wait_replicas=1, wait_timeout_ms=300)
    script = client.register_script("redis.call('SET', KEYS[1], ARGV[1]) return 1")
    name = "stargrpc:redirected-durable-write"
    try:
        await client.set(name, "before")  # the slot map, learnt while the slot is at source
        await client.script_load(script.script)  # so that EVALSHA meets the redirect
        slot = key_slot(name.encode())
        # Each node's role as it says itself (another node's view may lag just after start).
        replication = {port: redis_cli(port, "info", "replication").splitlines()
                       for port in redis_cluster.ports}
        primaries = [port for port, lines in replication.items() if "role:master" in lines]
        source = next(p for p in primaries if slot in redis_cluster.slots_of(p))
        target = next(p for p in primaries if p != source)
        assert redis_cluster.move_slots(source, target, [slot]) == 1
        replica = next(port for port, lines in replication.items()
                       if "role:slave" in lines and f"master_port:{target}" in lines)
        redis_cluster.kill(replica)

        first = await store.shared.scripts.call_all(script, [([name], ["after"])], durable=True)
        # Not written elsewhere without its WAIT: answered with the redirect, to try again.
        assert isinstance(first[0], MovedError) and isinstance(first[0], SLOT_MOVING)
        assert await client.get(name) == b"before"
        # Sent again (by the claim or the flush), it goes to the node serving the slot now,
        # with its own WAIT, which tells that no replica has the write.
        with pytest.raises(NotReplicated):
            await store.shared.scripts.call_all(script, [([name], ["after"])], durable=True)
    finally:
        await client.aclose()
