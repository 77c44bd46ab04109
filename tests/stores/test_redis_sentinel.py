"""The run store behind Sentinel (one primary, one replica, three Sentinels on loopback):
keyed calls across two replicas go on through a failover (the primary killed, Sentinel
promoting the replica), and redis_wait_replicas makes a write count only once a replica
acknowledged it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc

from stargrpc.v1 import events_pb2, tool_service_pb2_grpc
from tests.runs_support import HeaderPrincipal, collect, execute_request, key, run_registry
from tests.stores.conftest import LoopbackSentinel
from tests.stores.helpers import assert_whole, keyed_call


async def _replica(make_server, url: str, **overrides: Any) -> Any:
    return await make_server(registry=run_registry(), interceptors=[HeaderPrincipal()],
                             redis_url=url, run_lease_seconds=5.0, redis_timeout_seconds=1.0,
                             **overrides)


async def test_keyed_calls_go_on_through_a_sentinel_failover(
        make_server, redis_sentinel: LoopbackSentinel, tmp_path: Path) -> None:
    replicas = [await _replica(make_server, redis_sentinel.url) for _ in range(2)]
    gate = tmp_path / "gate"
    gate.touch()
    old = redis_sentinel.primary
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{r.port}") for r in replicas]
    try:
        stubs = [tool_service_pb2_grpc.ToolServiceStub(channel) for channel in channels]
        before = await asyncio.gather(*(keyed_call(stubs, i, tmp_path, gate)
                                        for i in range(40)))
        redis_sentinel.kill(old)
        during = asyncio.gather(*(keyed_call(stubs, i, tmp_path, gate)
                                  for i in range(40, 120)))
        calls = [*before, *await asyncio.wait_for(during, 120)]
        promoted = await asyncio.to_thread(redis_sentinel.current_primary)
    finally:
        for channel in channels:
            await channel.close()

    assert promoted == redis_sentinel.replica
    for tally, streams in calls:
        for events in streams:
            assert_whole(events)
        assert streams[-1][-1].result.outcome == events_pb2.OUTCOME_OK
        ran = Path(tally).read_text().split()  # noqa: ASYNC240 - after every call ended
        assert ran[-1] == streams[-1][0].run_id and len(set(ran)) == len(ran)


async def test_wait_replicas_acknowledge_writes_and_a_missing_replica_fails_the_call(
        make_server, redis_sentinel: LoopbackSentinel, tmp_path: Path) -> None:
    server = await _replica(make_server, redis_sentinel.url, redis_wait_replicas=1,
                            redis_wait_timeout_ms=300)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        acknowledged = await collect(stub.Execute(execute_request(
            "echo", {"text": "kept"}, idempotency_key=key())))
        redis_sentinel.kill(redis_sentinel.replica)
        try:
            await collect(stub.Execute(execute_request("echo", {"text": "lost?"},
                                                       idempotency_key=key())))
        except grpc.aio.AioRpcError as exc:
            refused = exc
        else:
            raise AssertionError("a claim no replica acknowledged counted as made")
        # The server keeps serving: a call without a key still runs (its events stay queued
        # for Redis, in this replica, until a replica acknowledges them).
        plain = await collect(stub.Execute(execute_request("echo", {"text": "still"})))

    assert_whole(acknowledged)
    assert acknowledged[-1].result.outcome == events_pb2.OUTCOME_OK
    assert refused.code() == grpc.StatusCode.UNAVAILABLE
    assert "redis_wait_replicas" in (refused.details() or "")
    assert plain[-1].result.outcome == events_pb2.OUTCOME_OK
