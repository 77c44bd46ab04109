"""A Redis that stalls (SIGSTOP, then SIGCONT) rather than dies: writes it applies after their
round trip timed out are not written twice, a keyed call fails within redis_timeout_seconds
and its retry runs the tool, a run outlives a stall longer than its lease (every event
reaches Redis once, in order, and a watcher on another replica sees them all), and a run
declared lost by another replica, or meeting a conflicting event, is stopped with a clear
Result. Each test stalls a redis-server of its own (never the shared one) and is bounded in
time."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from redis.asyncio import Redis
from structlog.testing import capture_logs

from stargrpc.errors import Unavailable
from stargrpc.server.grpc_server import StargrpcServer
from stargrpc.stores.redis import RedisRunStore
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.helpers import status_details
from tests.runs_support import HeaderPrincipal, collect, execute_request, key, run_registry
from tests.stores.conftest import REDIS_URL, StallableRedis

#: redis_timeout_seconds of the servers here; their flush round trips time out after 1.5 s.
TIMEOUT = 0.5
#: run_lease_seconds of the servers here (the smallest allowed).
LEASE = 1.0


def _step(phase: int) -> events_pb2.RunEvent:
    event = events_pb2.RunEvent()
    event.step.phase = phase  # type: ignore[assignment]
    event.step.step.id = "s0"
    return event


async def _stored(redis: Redis, stream: str) -> list[events_pb2.RunEvent]:
    """The events of a run's stream in Redis."""
    entries: Any = await redis.xrange(stream)  # the client's reply types are loose
    return [events_pb2.RunEvent.FromString(fields[b"e"]) for _, fields in entries]


def _assert_whole(events: list[events_pb2.RunEvent]) -> None:
    """Seqs 1..N with no gap and no repeat, the Result last and only there."""
    assert [event.seq for event in events] == list(range(1, len(events) + 1))
    assert [event.HasField("result") for event in events] == [False] * (len(events) - 1) + [True]


async def _serve(make_server, redis_url: str, prefix: str = "stargrpc:") -> StargrpcServer:
    server: StargrpcServer = await make_server(
        registry=run_registry(), interceptors=[HeaderPrincipal()], redis_url=redis_url,
        redis_key_prefix=prefix, redis_timeout_seconds=TIMEOUT, run_lease_seconds=LEASE)
    return server


@pytest.fixture
async def plain_client(stallable_redis: StallableRedis) -> AsyncIterator[Redis]:
    """A client of the test's own Redis, for looking at what the servers wrote."""
    client = Redis.from_url(stallable_redis.url)
    yield client
    await client.aclose()


async def test_a_batch_applied_after_its_round_trip_timed_out_is_not_written_again(
        stallable_redis: StallableRedis, plain_client: Redis) -> None:
    store = RedisRunStore(Redis.from_url(stallable_redis.url), flush_timeout=0.3)
    try:
        run_log = store.create(uuid.uuid4().hex, owner="alice", tool="echo")
        await store.publish(run_log)
        run_log.append_nowait(_step(events_pb2.STEP_PHASE_START))
        assert await store.flushed(10)
        stallable_redis.stall()
        run_log.append_nowait(_step(events_pb2.STEP_PHASE_DELTA))
        run_log.append_nowait(_step(events_pb2.STEP_PHASE_END))
        # The round trip times out; Redis holds the batch and applies it when it resumes.
        timed_out = not await store.flushed(1.0)
        stallable_redis.resume()
        run_log.append_nowait(_step(events_pb2.STEP_PHASE_START))
        flushed = await store.flushed(10)
        stored = await _stored(plain_client, f"stargrpc:run:{run_log.run_id}:events")
    finally:
        stallable_redis.resume()
        await store.aclose()

    assert timed_out
    assert flushed  # the resent batch counted as written, and the next one went on
    assert [event.seq for event in stored] == [1, 2, 3, 4]
    assert [event.step.phase for event in stored] == [
        events_pb2.STEP_PHASE_START, events_pb2.STEP_PHASE_DELTA, events_pb2.STEP_PHASE_END,
        events_pb2.STEP_PHASE_START]


async def test_a_claim_applied_twice_is_won_by_its_own_run(redis_prefix: str) -> None:
    store = RedisRunStore(Redis.from_url(REDIS_URL), prefix=redis_prefix)
    try:
        run_log = store.create(uuid.uuid4().hex, owner="alice", tool="echo")
        await store.publish(run_log)
        first = await store.claim("alice", "k", "fp", run_log)
        # As when the first reply was lost and the claim is sent again.
        again = await store.claim("alice", "k", "fp", run_log)
    finally:
        await store.aclose()

    assert first.won and first.run_id == run_log.run_id
    assert again.won and again.run_id == run_log.run_id


async def test_a_claim_allows_for_a_redis_clock_ahead_of_the_replicas(
        redis_prefix: str) -> None:
    store = RedisRunStore(Redis.from_url(REDIS_URL), prefix=redis_prefix)
    # As seen from a replica whose clock is 5 s behind Redis's (the clocks here agree).
    store.shared.clock_ahead_ms = -5000
    try:
        run_log = store.create(uuid.uuid4().hex, owner="alice", tool="echo")
        await store.publish(run_log)
        with capture_logs() as logs:
            claim = await store.claim("alice", "k", "fp", run_log)
    finally:
        await store.aclose()

    assert claim.won
    assert [entry["event"] for entry in logs] == ["redis_clock_ahead"]


async def test_a_claim_redis_found_late_is_told_as_such_not_as_redis_unreachable(
        redis_prefix: str) -> None:
    # Redis answers the claim (its clock says the call's deadline passed): the call is
    # refused for running out of time, and the log says Redis answered late, not that it
    # was unreachable or did not answer.
    store = RedisRunStore(Redis.from_url(REDIS_URL), prefix=redis_prefix)
    store.shared.deadline_ms = lambda deadline: 1  # type: ignore[method-assign]
    try:
        run_log = store.create(uuid.uuid4().hex, owner="alice", tool="echo")
        await store.publish(run_log)
        with capture_logs() as logs, pytest.raises(Unavailable) as refused:
            await store.claim("alice", "k", "fp", run_log)
    finally:
        await store.aclose()

    assert "did not answer in time (claiming the idempotency key)" in str(refused.value)
    assert [(entry["event"], entry.get("error")) for entry in logs
            if entry["event"] != "redis_clock_ahead"] == [
        ("redis_unavailable", "the call's deadline passed before Redis took the claim")]


async def test_the_calls_own_deadline_in_a_stall_is_told_as_such(
        stallable_redis: StallableRedis) -> None:
    # No socket timeout: only the store's own deadlines (asyncio.timeout) end these calls,
    # and each says it ran out of time rather than that Redis is unreachable.
    # The connection is made and Redis found healthy under a long deadline (on a loaded
    # machine connecting alone can take longer than the short one); only the calls in
    # the stall have 0.3 s.
    store = RedisRunStore(Redis.from_url(stallable_redis.url), timeout=30)
    try:
        await store.publish(store.create(uuid.uuid4().hex, owner="alice", tool="echo"))
        store.shared.timeout = 0.3
        run_log = store.create(uuid.uuid4().hex, owner="alice", tool="echo")
        await store.publish(run_log)  # healthy: no round trip, its deadline 0.3 s from now
        stallable_redis.stall()
        with capture_logs() as logs, pytest.raises(Unavailable) as claim_refused:
            await store.claim("alice", "k", "fp", run_log)
        store.healthy = False  # the next publish asks Redis first
        with pytest.raises(Unavailable) as publish_refused:
            await store.publish(store.create(uuid.uuid4().hex, owner="alice", tool="echo"))
    finally:
        stallable_redis.resume()
        await store.aclose()

    assert "did not answer in time (claiming the idempotency key)" in str(claim_refused.value)
    assert "did not answer in time (registering the run)" in str(publish_refused.value)
    assert ("redis_unavailable", "no answer in time") in [
        (entry["event"], entry.get("error")) for entry in logs]


async def test_a_keyed_call_in_a_stall_fails_within_the_timeout_and_its_retry_runs_once(
        stallable_redis: StallableRedis, make_server, tmp_path: Path) -> None:
    server = await _serve(make_server, stallable_redis.url)
    tally = tmp_path / "tally"
    request = execute_request("tally", {"path": str(tally)}, idempotency_key=key())
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        warm = await collect(stub.Execute(execute_request("echo", {"text": "hi"},
                                                          idempotency_key=key()), timeout=20))
        stallable_redis.stall()
        started = time.monotonic()
        try:
            with pytest.raises(grpc.aio.AioRpcError) as stalled:
                await collect(stub.Execute(request, timeout=20))
            waited = time.monotonic() - started
        finally:
            stallable_redis.resume()
        retried = await collect(stub.Execute(request, timeout=30))
        again = await collect(stub.Execute(request, timeout=30))

    details = status_details(stalled.value)
    assert warm[-1].result.output == "hi"
    assert stalled.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "Redis" in (stalled.value.details() or "")
    assert details[0].reason == "RUN_STORE_UNAVAILABLE"
    assert details[1].retry_delay.ToNanoseconds() > 0  # RetryInfo
    # Within redis_timeout_seconds, and well short of a socket timeout (1.5 s) plus a retry.
    assert waited < TIMEOUT + 0.8
    assert retried[-1].result.outcome == events_pb2.OUTCOME_OK, retried[-1].result
    assert again[0].run_id == retried[0].run_id
    assert tally.read_text().split() == [retried[0].run_id]  # the tool ran once


@dataclass
class WatchedRun:
    """A gated tally run on replica A, followed by a watcher on replica B."""

    gate: Path
    stub_b: tool_service_pb2_grpc.ToolServiceStub
    call: Any
    first: events_pb2.RunEvent
    watcher: Any
    seen: list[events_pb2.RunEvent]


@asynccontextmanager
async def _watched_run(make_server, redis_url: str, folder: Path
                       ) -> AsyncIterator[WatchedRun]:
    a = await _serve(make_server, redis_url)
    b = await _serve(make_server, redis_url)
    gate = folder / "gate"
    # The tool heartbeats every 50 ms until the gate opens: events keep coming in a stall.
    request = execute_request("tally", {"path": str(folder / "tally"), "gate": str(gate)},
                              idempotency_key=key())
    async with grpc.aio.insecure_channel(f"127.0.0.1:{a.port}") as chan_a, \
            grpc.aio.insecure_channel(f"127.0.0.1:{b.port}") as chan_b:
        stub_b = tool_service_pb2_grpc.ToolServiceStub(chan_b)
        call = tool_service_pb2_grpc.ToolServiceStub(chan_a).Execute(request, timeout=90)
        first = (await call.read()).event
        watcher = stub_b.WatchRun(tool_service_pb2.WatchRunRequest(run_id=first.run_id),
                                  timeout=60)
        seen = [(await watcher.read()).event]  # B follows the run
        yield WatchedRun(gate, stub_b, call, first, watcher, seen)


async def test_a_run_outlives_a_stall_longer_than_its_lease(
        stallable_redis: StallableRedis, plain_client: Redis, make_server,
        tmp_path: Path) -> None:
    async with _watched_run(make_server, stallable_redis.url, tmp_path) as run:
        call, first, watcher, seen = run.call, run.first, run.watcher, run.seen
        stallable_redis.stall()
        try:
            # Longer than a flush round trip may take (1.5 s) and than the lease (1 s).
            await asyncio.sleep(2.5)
        finally:
            stallable_redis.resume()
        # B follows on past the time in which it could have declared the run lost.
        resumed = time.time()
        while not seen[-1].HasField("result") and \
                seen[-1].time.ToNanoseconds() < (resumed + 3 * LEASE) * 1e9:
            seen.append((await asyncio.wait_for(watcher.read(), 30)).event)
        run.gate.touch()
        own = [first, *await asyncio.wait_for(collect(call), 30)]
        seen += await asyncio.wait_for(collect(watcher), 30)
        stored = await _stored(plain_client, f"stargrpc:run:{first.run_id}:events")

    _assert_whole(own)
    assert own[-1].result.outcome == events_pb2.OUTCOME_OK, own[-1].result
    assert len(own) > 40  # heartbeats of the stall included
    assert [e.SerializeToString() for e in stored] == [e.SerializeToString() for e in own]
    assert [e.SerializeToString() for e in seen] == [e.SerializeToString() for e in own]
    assert seen[-1].result.outcome == events_pb2.OUTCOME_OK, seen[-1].result


async def test_watch_and_cancel_in_a_long_stall_end_unavailable_and_the_run_goes_on(
        stallable_redis: StallableRedis, make_server, tmp_path: Path) -> None:
    async with _watched_run(make_server, stallable_redis.url, tmp_path) as run:
        call, first, watcher, stub_b = run.call, run.first, run.watcher, run.stub_b
        stallable_redis.stall()
        try:
            with pytest.raises(grpc.aio.AioRpcError) as cancel_stalled:
                await stub_b.CancelRun(tool_service_pb2.CancelRunRequest(
                    run_id=first.run_id, reason="stop"), timeout=20)
            # Longer than the run could be going unseen (lease + as long again): ended.
            with pytest.raises(grpc.aio.AioRpcError) as watch_stalled:
                await asyncio.wait_for(collect(watcher), 30)
        finally:
            stallable_redis.resume()
        run.gate.touch()
        own = [first, *await asyncio.wait_for(collect(call), 30)]
        resumed = await asyncio.wait_for(collect(stub_b.WatchRun(
            tool_service_pb2.WatchRunRequest(run_id=first.run_id, after_seq=1), timeout=30)),
            30)

    for error in (cancel_stalled.value, watch_stalled.value):
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert status_details(error)[0].reason == "RUN_STORE_UNAVAILABLE"
    _assert_whole(own)
    assert own[-1].result.outcome == events_pb2.OUTCOME_OK, own[-1].result
    assert [e.SerializeToString() for e in resumed] == [e.SerializeToString() for e in own[1:]]


async def test_redis_killed_in_a_stall_ends_the_run_with_a_result_and_serving_goes_on(
        stallable_redis: StallableRedis, make_server, tmp_path: Path) -> None:
    server = await _serve(make_server, stallable_redis.url)
    gate = tmp_path / "gate"
    request = execute_request("tally", {"path": str(tmp_path / "tally"), "gate": str(gate)},
                              idempotency_key=key())
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        call = stub.Execute(request, timeout=60)
        first = (await call.read()).event
        stallable_redis.stall()
        stallable_redis.kill()
        await stallable_redis.start()  # empty: the run's record is gone
        rest = await asyncio.wait_for(collect(call), 30)
        gate.touch()
        after = await collect(stub.Execute(execute_request("echo", {"text": "hi"},
                                                           idempotency_key=key()), timeout=20))

    # Its replica learns the record is gone and stops the run: a retry may run it again.
    assert rest[-1].run_id == first.run_id
    assert rest[-1].result.outcome == events_pb2.OUTCOME_ERROR
    assert rest[-1].result.error.code == "RUN_LOST"
    assert after[-1].result.output == "hi"


async def test_a_run_declared_lost_elsewhere_is_stopped_by_its_live_replica(
        replicas, redis_prefix: str, tmp_path: Path) -> None:
    server = await replicas(run_lease_seconds=LEASE)
    redis = Redis.from_url(REDIS_URL)
    gate = tmp_path / "gate"
    request = execute_request("tally", {"path": str(tmp_path / "tally"), "gate": str(gate)},
                              idempotency_key=key())
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = tool_service_pb2_grpc.ToolServiceStub(channel)
            call = stub.Execute(request, timeout=60)
            first = (await call.read()).event
            meta = f"{redis_prefix}run:{first.run_id}"
            # What another replica does to a run whose lease it saw lapsed for a whole lease
            # (its replica cut off from Redis, say): the RUN_LOST Result, in one step.
            lost = events_pb2.RunEvent(run_id=first.run_id)
            lost.result.outcome = events_pb2.OUTCOME_ERROR
            lost.result.error.code = "RUN_LOST"
            await redis.eval("""
                local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
                local seq = 1
                if #last > 0 then seq = tonumber(string.match(last[1][1], '^%d+')) + 1 end
                redis.call('DEL', KEYS[1])
                redis.call('HSET', KEYS[3], 'state', 'lost')
                redis.call('XADD', KEYS[2], seq .. '-0', 'e', ARGV[1])
            """, 3, f"{meta}:lease", f"{meta}:events", meta, lost.SerializeToString())
            rest = await asyncio.wait_for(collect(call), 15)
            stored = await _stored(redis, f"{meta}:events")
    finally:
        await redis.aclose()

    assert rest[-1].result.outcome == events_pb2.OUTCOME_ERROR
    assert rest[-1].result.error.code == "RUN_LOST"
    assert stored[-1].result.error.code == "RUN_LOST"  # nothing written after it
    assert not gate.exists()


async def test_a_conflicting_event_in_redis_fails_the_run_closed(
        replicas, redis_prefix: str, tmp_path: Path) -> None:
    server = await replicas()
    redis = Redis.from_url(REDIS_URL)
    gate = tmp_path / "gate"
    request = execute_request("tally", {"path": str(tmp_path / "tally"), "gate": str(gate)},
                              idempotency_key=key())
    intruder = events_pb2.RunEvent()
    intruder.notice.message = "written by someone else"
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = tool_service_pb2_grpc.ToolServiceStub(channel)
            with capture_logs() as logs:
                call = stub.Execute(request, timeout=60)
                first = (await call.read()).event
                events = f"{redis_prefix}run:{first.run_id}:events"
                # The next seq the replica will write, taken first by another writer.
                await redis.eval("""
                    local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
                    local seq = 1
                    if #last > 0 then seq = tonumber(string.match(last[1][1], '^%d+')) + 1 end
                    redis.call('XADD', KEYS[1], seq .. '-0', 'e', ARGV[1])
                """, 1, events, intruder.SerializeToString())
                rest = await asyncio.wait_for(collect(call), 15)
            stored = await _stored(redis, events)
            watched = await asyncio.wait_for(collect(stub.WatchRun(
                tool_service_pb2.WatchRunRequest(run_id=first.run_id), timeout=15)), 15)
    finally:
        await redis.aclose()

    assert rest[-1].result.outcome == events_pb2.OUTCOME_ERROR
    assert rest[-1].result.error.code == "STORE_CONFLICT"
    assert stored[-1].result.error.code == "STORE_CONFLICT"  # watchers are told too
    assert watched[-1].result.error.code == "STORE_CONFLICT"
    assert any(entry["event"] == "run_store_conflict" and entry["log_level"] == "critical"
               for entry in logs)
    assert not gate.exists()



async def test_a_shutdown_in_a_stall_names_the_runs_redis_did_not_take(
        stallable_redis: StallableRedis, make_server, tmp_path: Path) -> None:
    # Redis holds the run cut short (no Result; its key held until a sweep declares it
    # lost): the operator is told which runs, not left to find them.
    server = await _serve(make_server, stallable_redis.url)
    request = execute_request("tally", {"path": str(tmp_path / "tally"),
                                        "gate": str(tmp_path / "gate")}, idempotency_key=key())
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        call = stub.Execute(request, timeout=60)
        first = (await call.read()).event
        stallable_redis.stall()
        try:
            with capture_logs() as logs:
                await asyncio.wait_for(server.stop(grace=0.2), 60)
        finally:
            stallable_redis.resume()
        rest = await asyncio.wait_for(collect(call), 30)
    assert rest[-1].result.outcome == events_pb2.OUTCOME_CANCELLED
    unflushed = [line for line in logs if line["event"] == "redis_runs_not_flushed"]
    assert [line["run_ids"] for line in unflushed] == [[first.run_id]]
