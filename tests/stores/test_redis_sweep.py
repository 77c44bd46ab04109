"""The sweep for lost runs: a run whose replica died ends ``Result{ERROR, RUN_LOST}`` in Redis
within about two leases of the death with nobody watching it, and a delivery of its Result is
delivered by another replica; a live run is left alone by every sweeper; two sweepers end a
lost run once; the sweep works on a Redis Cluster, and rides out a stalled or absent Redis
(it logs and sweeps again). Each wait is bounded and waits on Redis (a blocking read of the
run's stream), never a fixed sleep."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from structlog.testing import capture_logs

from stargrpc import metrics
from stargrpc.stores.connect import connect
from stargrpc.stores.redis import RedisRunLog, RedisRunStore
from stargrpc.v1 import events_pb2, tool_service_pb2_grpc
from tests.delivery.helpers import read_entry, start_request
from tests.helpers import eventually, free_port
from tests.procs import ServerProcess, server_env
from tests.runs_support import RUN_TOOLS_DIR
from tests.stores.conftest import REDIS_URL, LoopbackCluster, StallableRedis
from tests.stores.helpers import OwnRedis

#: run_lease_seconds of the replicas here.
LEASE = 2.0
#: run_sweep_interval_seconds of the surviving replicas here.
SWEEP = 0.25
#: How long after a replica's death its runs may take to end RUN_LOST: its lease running
#: out, a sweep to see it lapsed, the grace of a whole further lease, a sweep to look again
#: and one to end it — and a margin for a busy test machine.
LOST_WITHIN = 2 * LEASE + 3 * SWEEP + 2.0


def _step(phase: int) -> events_pb2.RunEvent:
    event = events_pb2.RunEvent()
    event.step.phase = phase  # type: ignore[assignment]
    event.step.step.id = "s0"
    return event


async def _result_in_redis(redis: Redis | RedisCluster, stream: str, within: float
                           ) -> events_pb2.RunEvent:
    """The Result event of a run's stream, waited for with blocking reads (bounded)."""
    last = "0-0"
    async with asyncio.timeout(within):
        while True:
            reply: Any = await redis.xread({stream: last}, count=100, block=200)
            for _, entries in reply:
                for entry_id, fields in entries:
                    last = entry_id
                    event = events_pb2.RunEvent.FromString(fields[b"e"])
                    if event.HasField("result"):
                        return event


async def _results(redis: Redis | RedisCluster, stream: str) -> list[events_pb2.RunEvent]:
    entries: Any = await redis.xrange(stream)
    events = [events_pb2.RunEvent.FromString(fields[b"e"]) for _, fields in entries]
    return [event for event in events if event.HasField("result")]


async def _running_run(store: RedisRunStore) -> RedisRunLog:
    """A run of ``store`` with its first events in Redis (registered, leased)."""
    run_log = store.create(str(uuid.uuid4()), owner="alice", tool="tally")
    await store.publish(run_log)
    run_log.append_nowait(_step(events_pb2.STEP_PHASE_START))
    assert await store.flushed(10)
    return run_log


async def _abandon(store: RedisRunStore) -> None:
    """What SIGKILL does to a replica, as Redis sees it: nothing more is written or renewed
    (its connections are left as they are)."""
    await store.stop_renewing()
    await store.flusher.stop()
    await store.sweep.stop()
    store.runs.clear()


def _swept(logs: list[dict[str, Any]], run_id: str) -> list[dict[str, Any]]:
    return [line for line in logs if line["event"] == "run_lost"
            and line.get("run_id") == run_id and line.get("noticed_by") == "sweep"]


async def test_a_killed_replicas_runs_end_run_lost_unwatched_and_its_delivery_is_delivered(
        replicas, redis_prefix: str, tmp_path: Path) -> None:
    await replicas(run_lease_seconds=LEASE, run_sweep_interval_seconds=SWEEP)
    doomed = ServerProcess(
        ["--tools-dir", str(RUN_TOOLS_DIR), "--redis-url", REDIS_URL],
        server_env(tmp_path / "a", STARGRPC_REDIS_KEY_PREFIX=redis_prefix,
                   STARGRPC_RUN_LEASE_SECONDS=str(LEASE)))
    redis = Redis.from_url(REDIS_URL)
    swept_before = metrics.RUNS_LOST.labels("sweep")._value.get()
    try:
        arguments = {"path": str(tmp_path / "tally"), "gate": str(tmp_path / "never")}
        async with grpc.aio.insecure_channel(doomed.target) as channel:
            stub = tool_service_pb2_grpc.ToolServiceStub(channel)
            delivered = await stub.StartRun(start_request("tally", arguments, "results"))
            unwatched = start_request("tally", arguments, "results")
            unwatched.ClearField("delivery")  # nobody will ever look at this one
            alone = await stub.StartRun(unwatched)
        run_ids = [delivered.run_id, alone.run_id]
        async def in_redis() -> bool:
            return all([await redis.hexists(f"{redis_prefix}delivery:pending",
                                            delivered.run_id),
                        *[await redis.exists(f"{redis_prefix}run:{run_id}:lease")
                          for run_id in run_ids]])

        # Both runs in Redis, leased (their first events flushed), and the delivery: another
        # process writes them, so there is no event to await here.
        await eventually(in_redis, within=20, interval=0.05,
                         what="both runs and the delivery in Redis")
        with capture_logs() as logs:
            doomed.signal(signal.SIGKILL)
            killed = time.monotonic()
            results = [await _result_in_redis(redis, f"{redis_prefix}run:{run_id}:events",
                                              LOST_WITHIN + 5) for run_id in run_ids]
            lost_after = time.monotonic() - killed
            entry = await read_entry(redis, f"{redis_prefix}results", delivered.run_id, 30)
        state = await redis.hget(f"{redis_prefix}run:{alone.run_id}", "state")

        async def unlisted() -> bool:
            listed = await redis.zrange(f"{redis_prefix}runs:running", 0, -1)
            return not set(run_ids) & {raw.decode() for raw in listed}

        # Taken out of the sweep's set a round trip after the Result: no event to await.
        await eventually(unlisted, within=10, interval=0.05, what="the runs out of runs:running")
    finally:
        doomed.stop()
        await redis.aclose()

    assert [result.result.error.code for result in results] == ["RUN_LOST"] * 2
    assert lost_after < LOST_WITHIN, f"the runs ended RUN_LOST {lost_after:.1f} s after the kill"
    assert state == b"lost"
    # The survivor's sweep ended the run nobody looked at (logged with the dead replica's id,
    # and counted); the other, the sweep or the delivery taken over, whichever came first.
    swept = _swept(logs, alone.run_id)
    assert len(swept) == 1 and swept[0]["replica"] and swept[0]["tool"] == "tally", logs
    assert metrics.RUNS_LOST.labels("sweep")._value.get() >= swept_before + 1
    # The delivery the dead replica left is taken over and delivers that Result.
    assert entry["outcome"] == "OUTCOME_ERROR"
    assert json.loads(entry["result"])["error"]["code"] == "RUN_LOST"


@pytest.fixture
async def stores(redis_prefix: str) -> AsyncIterator[list[RedisRunStore]]:
    """Stores on the shared Redis under this test's prefix; closed afterwards."""
    made: list[RedisRunStore] = []
    yield made
    for store in made:
        await store.aclose()


async def test_two_sweepers_end_a_lost_run_once_and_leave_a_live_run_alone(
        stores: list[RedisRunStore], redis_prefix: str) -> None:
    def store() -> RedisRunStore:
        made = RedisRunStore(Redis.from_url(REDIS_URL), prefix=redis_prefix, lease=1.0,
                             sweep_interval=0.05)
        stores.append(made)
        return made

    dead, live, other = store(), store(), store()
    await live.start()
    await other.start()
    lost_log = await _running_run(dead)
    live_log = await _running_run(live)
    await _abandon(dead)
    with capture_logs() as logs:
        abandoned = time.monotonic()
        result = await _result_in_redis(live.redis, live.shared.key(lost_log.run_id, "events"),
                                        2 * 1.0 + 3 * 0.05 + 5)
        lost_after = time.monotonic() - abandoned
        # Past two more leases: a run that keeps its lease is never ended by a sweep.
        until = time.monotonic() + 2.5
        while time.monotonic() < until:
            live_log.append_nowait(_step(events_pb2.STEP_PHASE_DELTA))
            assert await live.flushed(5)
            await asyncio.sleep(0.1)  # a run's pace, not a wait for something to happen
        lost_results = await _results(live.redis, live.shared.key(lost_log.run_id, "events"))
        live_results = await _results(live.redis, live.shared.key(live_log.run_id, "events"))
        live_state = await live.leases.state(live_log.run_id)
        due: Any = await live.redis.zscore(f"{redis_prefix}runs:running", live_log.run_id)

    assert result.result.error.code == "RUN_LOST"
    assert lost_after < 2 * 1.0 + 3 * 0.05 + 2.0
    assert len(lost_results) == 1  # once, by one of the two sweepers
    assert len(_swept(logs, lost_log.run_id)) == 1
    assert _swept(logs, lost_log.run_id)[0]["replica"] == dead.replica
    assert live_results == [] and live_state == "running"
    assert due is not None  # still swept, put back until its lease could lapse
    assert not [line for line in logs if line["log_level"] in ("error", "critical")]


async def _lost_after_registering(dead: RedisRunStore, survivor: RedisRunStore,
                                  monkeypatch: pytest.MonkeyPatch, registered_by: str
                                  ) -> tuple[str, str]:
    """A run registered in Redis by ``dead`` (by its first flush, its idempotency claim, or
    ahead of its start), a replica that dies right after the round trip registering it,
    before the next (the ListRuns indexes): its state in Redis then, and the code of the
    Result the sweep of ``survivor`` ends it with."""
    await survivor.start()
    died = asyncio.Event()

    async def death(*_: Any) -> None:
        died.set()
        await asyncio.Event().wait()  # nothing more is written: the replica is gone

    monkeypatch.setattr(dead.index, "add", death)
    run_log = dead.create(str(uuid.uuid4()), owner="alice", tool="tally")
    await dead.publish(run_log)
    registering = None
    if registered_by == "claim":
        registering = asyncio.create_task(dead.claim("alice", run_log.run_id, "fp", run_log))
    elif registered_by == "register":
        registering = asyncio.create_task(dead.register(run_log))
    else:
        run_log.append_nowait(_step(events_pb2.STEP_PHASE_START))
    await died.wait()
    if registering is not None:
        registering.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await registering
    await _abandon(dead)
    registered = await survivor.leases.state(run_log.run_id)
    result = await _result_in_redis(survivor.redis, survivor.shared.key(run_log.run_id, "events"),
                                    2 * 1.0 + 3 * 0.05 + 5)
    return registered, result.result.error.code


# A run enters the sweep's set in the round trip registering it: a replica killed between
# that round trip and the next leaves no run "running" for good, unswept.
REGISTERED_BY = ["flush", "claim", "register"]


@pytest.mark.parametrize("registered_by", REGISTERED_BY)
async def test_a_replica_dying_right_after_registering_a_run_leaves_it_to_the_sweep(
        registered_by: str, stores: list[RedisRunStore], redis_prefix: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    stores.extend(RedisRunStore(Redis.from_url(REDIS_URL), prefix=redis_prefix, lease=1.0,
                                sweep_interval=0.05) for _ in range(2))
    assert await _lost_after_registering(*stores, monkeypatch, registered_by) == (
        "running", "RUN_LOST")


@pytest.mark.parametrize("registered_by", REGISTERED_BY)
async def test_a_replica_dying_right_after_registering_a_run_on_a_cluster_leaves_it_to_the_sweep(
        registered_by: str, redis_cluster: LoopbackCluster, stores: list[RedisRunStore],
        monkeypatch: pytest.MonkeyPatch) -> None:
    stores.extend(RedisRunStore(connect(redis_cluster.url, timeout=2.0)[0], lease=1.0,
                                sweep_interval=0.05) for _ in range(2))
    assert await _lost_after_registering(*stores, monkeypatch, registered_by) == (
        "running", "RUN_LOST")


async def test_a_stalled_node_of_the_sweeps_set_holds_up_no_claim_on_a_cluster(
        redis_cluster: LoopbackCluster, stores: list[RedisRunStore]) -> None:
    # runs:running lives on one node, a run's keys and its claim on others: with that node
    # stalled, a claim still registers its run and wins (the set is written beside it, the
    # indexes after the call's deadline, and a script only loaded where it is missing).
    client, _ = connect(redis_cluster.url, timeout=1.0)
    store = RedisRunStore(client, lease=2.0, timeout=1.0)
    stores.append(store)
    assert isinstance(client, RedisCluster)
    await client.initialize()  # the slots' map, read while every node answers
    node = client.get_node_from_key(store.sweep.key)
    assert node is not None

    def elsewhere(name: Callable[[str], str]) -> str:
        return next(candidate for candidate in (uuid.uuid4().hex for _ in range(1000))
                    if client.get_node_from_key(name(candidate)) != node)

    # (The cluster is new: each script is loaded on the nodes of the calls that need it.)
    run_log = store.create(elsewhere(store.shared.key), owner="alice", tool="tally")
    key = elsewhere(lambda candidate: store.keys.claim("alice", candidate))
    await store.publish(run_log)
    stalled = redis_cluster.procs[int(node.port)]
    os.kill(stalled.pid, signal.SIGSTOP)
    try:
        claim = await store.claim("alice", key, "fp", run_log)
        state = await store.leases.state(run_log.run_id)
    finally:
        os.kill(stalled.pid, signal.SIGCONT)

    assert claim.won and state == "running"


async def test_a_finished_run_leaves_the_sweep_set_and_a_short_one_never_enters_it(
        stores: list[RedisRunStore], redis_prefix: str) -> None:
    store = RedisRunStore(Redis.from_url(REDIS_URL), prefix=redis_prefix, lease=1.0)
    stores.append(store)
    run_log = await _running_run(store)
    running_key = f"{redis_prefix}runs:running"
    while_running = await store.redis.zscore(running_key, run_log.run_id)
    ttl = await store.redis.pttl(running_key)
    result = events_pb2.RunEvent()
    result.result.outcome = events_pb2.OUTCOME_OK
    run_log.append_nowait(result)
    assert await store.flushed(10)
    after = await store.redis.zscore(running_key, run_log.run_id)
    # A run whose first write holds its Result is never put in (nothing to take out).
    short = store.create(str(uuid.uuid4()), owner="alice", tool="echo")
    await store.publish(short)
    short.append_nowait(_step(events_pb2.STEP_PHASE_START))
    short.append_nowait(result)
    assert await store.flushed(10)
    short_state = await store.leases.state(short.run_id)

    assert while_running is not None and after is None
    assert short_state == "finished" and not short.swept
    assert ttl > 0  # it expires with a fleet that is gone, like the other indexes


async def test_the_sweep_finds_lost_runs_on_a_redis_cluster(
        redis_cluster: LoopbackCluster) -> None:
    def store() -> RedisRunStore:
        client, _ = connect(redis_cluster.url, timeout=2.0)
        return RedisRunStore(client, lease=1.0, sweep_interval=0.05)

    dead, survivor = store(), store()
    try:
        await survivor.start()
        # Runs whose keys live on every primary (their ids are their hash tags).
        lost = [await _running_run(dead) for _ in range(12)]
        await _abandon(dead)
        abandoned = time.monotonic()
        results = [await _result_in_redis(survivor.redis, survivor.shared.key(run.run_id, "events"),
                                          2 * 1.0 + 3 * 0.05 + 5) for run in lost]
        lost_after = time.monotonic() - abandoned
        nodes = {survivor.redis.get_node_from_key(survivor.shared.key(run.run_id)).name  # type: ignore[union-attr]
                 for run in lost}
    finally:
        await dead.aclose()
        await survivor.aclose()

    assert isinstance(survivor.redis, RedisCluster)
    assert [result.result.error.code for result in results] == ["RUN_LOST"] * 12
    assert lost_after < 2 * 1.0 + 3 * 0.05 + 3.0
    assert len(nodes) > 1


async def test_the_sweep_rides_out_a_stalled_redis(stallable_redis: StallableRedis) -> None:
    def store() -> RedisRunStore:
        return RedisRunStore(Redis.from_url(stallable_redis.url, socket_timeout=0.3),
                             lease=1.0, sweep_interval=0.05, timeout=0.3, flush_timeout=0.3)

    dead, survivor = store(), store()
    try:
        await survivor.start()
        run_log = await _running_run(dead)
        await _abandon(dead)
        with capture_logs() as logs:
            stallable_redis.stall()
            try:
                # The sweeps meet the stall, and say so (a log line gives no event to await).
                await eventually(lambda: [line for line in logs
                                          if line["event"] == "redis_sweep_failed"],
                                 within=20, interval=0.05, what="a sweep failing")
            finally:
                stallable_redis.resume()
            resumed = time.monotonic()
            reader = Redis.from_url(stallable_redis.url)
            try:
                result = await _result_in_redis(
                    reader, survivor.shared.key(run_log.run_id, "events"), 2 * 1.0 + 3 * 0.05 + 5)
            finally:
                await reader.aclose()
            lost_after = time.monotonic() - resumed
        sweeping = survivor.sweep.running
    finally:
        stallable_redis.resume()
        await dead.aclose()
        await survivor.aclose()

    assert result.result.error.code == "RUN_LOST"
    assert lost_after < 2 * 1.0 + 3 * 0.05 + 2.0
    assert sweeping
    assert not [line for line in logs if line["event"] == "redis_sweep_error"]


async def test_the_sweep_waits_for_a_redis_that_is_down_and_sweeps_once_it_is_up(
        tmp_path: Path) -> None:
    own = OwnRedis(free_port(), tmp_path)
    url = f"redis://127.0.0.1:{own.port}/0"

    def store() -> RedisRunStore:
        return RedisRunStore(Redis.from_url(url, socket_timeout=0.3, socket_connect_timeout=0.3),
                             lease=1.0, sweep_interval=0.05, timeout=0.3, flush_timeout=0.3)

    survivor = store()
    dead = None
    try:
        with capture_logs() as logs:
            await survivor.start()
            await eventually(lambda: len([line for line in logs
                                          if line["event"] == "redis_sweep_failed"]) >= 3,
                             within=20, interval=0.05, what="three sweeps failing")
        await own.start()
        dead = store()
        run_log = await _running_run(dead)
        await _abandon(dead)
        abandoned = time.monotonic()
        result = await _result_in_redis(
            survivor.redis, survivor.shared.key(run_log.run_id, "events"), 2 * 1.0 + 3 * 0.05 + 5)
        lost_after = time.monotonic() - abandoned
    finally:
        if dead is not None:
            await dead.aclose()
        await survivor.aclose()
        own.stop()

    assert result.result.error.code == "RUN_LOST"
    assert lost_after < 2 * 1.0 + 3 * 0.05 + 2.0
