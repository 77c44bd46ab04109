"""Lanes on a Redis that stalls (SIGSTOP) rather than dies: a call that needs a lane slot
while Redis is stopped is refused UNAVAILABLE within a bound (it neither hangs nor runs
unadmitted), and once Redis resumes the lane admits and runs calls again, its slot given
back; a replica's reserve admits calls only while its leases surely run, and what lapsed in
the stall is dropped. The Redis here is the test's own (never the shared one)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest
from redis.asyncio import Redis

from stargrpc.stores.redis.lanes import RedisLanes
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.helpers import eventually
from tests.lanes.lane_helpers import lane_registry, lane_settings, nap_request
from tests.runs_support import HeaderPrincipal, as_principal, collect
from tests.stores.conftest import StallableRedis

ALICE = as_principal("alice")


async def test_a_lane_call_in_a_stall_is_refused_unavailable_and_the_lane_serves_after(
        stallable_redis: StallableRedis, make_server: Any, redis_prefix: str) -> None:
    server = await make_server(registry=lane_registry(), interceptors=[HeaderPrincipal()],
                               redis_url=stallable_redis.url, redis_key_prefix=redis_prefix,
                               redis_timeout_seconds=0.5, run_lease_seconds=1.0,
                               **lane_settings())
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        stallable_redis.stall()
        try:
            began = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as stalled:
                await asyncio.wait_for(collect(stub.Execute(nap_request(0.01), metadata=ALICE,
                                                            timeout=30)), 40)
            waited = time.monotonic() - began
        finally:
            stallable_redis.resume()
        assert stalled.value.code() == grpc.StatusCode.UNAVAILABLE, stalled.value
        assert waited < 20  # bounded by the store's timeouts, not by the call's deadline
        # Redis is back: the lane admits again, one call after the other through its slot.
        for _ in range(3):
            events = await asyncio.wait_for(
                collect(stub.Execute(nap_request(0.01), metadata=ALICE, timeout=30)), 40)
            assert events[-1].result.outcome == events_pb2.OUTCOME_OK, events[-1].result


async def test_a_reserve_in_a_stall_neither_hangs_a_call_nor_outlives_its_lease(
        stallable_redis: StallableRedis, make_server: Any, redis_prefix: str) -> None:
    lanes = lane_settings(slow={"max_concurrent": 40})
    server = await make_server(registry=lane_registry(), interceptors=[HeaderPrincipal()],
                               redis_url=stallable_redis.url, redis_key_prefix=redis_prefix,
                               redis_timeout_seconds=0.5, run_lease_seconds=1.0,
                               tool_lanes={"quick": "slow"}, **lanes)
    board = server.runtime.lanes
    assert isinstance(board, RedisLanes)
    quick = tool_service_pb2.ExecuteRequest(tool_name="quick")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        events = await collect(stub.Execute(quick, metadata=ALICE, timeout=30))
        assert events[-1].result.outcome == events_pb2.OUTCOME_OK
        assert board.reserve("slow")
        stallable_redis.stall()
        try:
            # A reserve slot may admit a call while its lease surely runs; the store decides
            # the rest as for any call: it runs, or is refused UNAVAILABLE, each within a
            # bound, and once the store has found Redis stalled every call is refused.
            refused = None
            for _ in range(10_000):
                try:
                    events = await asyncio.wait_for(
                        collect(stub.Execute(quick, metadata=ALICE, timeout=30)), 40)
                    assert events[-1].result.outcome == events_pb2.OUTCOME_OK
                except grpc.aio.AioRpcError as error:
                    refused = error
                    break
            assert refused is not None
            assert refused.code() == grpc.StatusCode.UNAVAILABLE, refused
        finally:
            stallable_redis.resume()
        for _ in range(3):
            events = await asyncio.wait_for(
                collect(stub.Execute(quick, metadata=ALICE, timeout=30)), 40)
            assert events[-1].result.outcome == events_pb2.OUTCOME_OK, events[-1].result
    # What the replica holds as its reserve is held in Redis (a slot that lapsed in the stall
    # was dropped), and the lane holds no more than its slots.
    redis = Redis.from_url(stallable_redis.url)
    try:
        slots_key = board.keys("slow")[0]

        async def coherent() -> bool:
            held = {slot.decode() for slot in await redis.zrange(slots_key, 0, -1)}
            return board.reserve("slow") <= held and len(held) <= 40

        await eventually(coherent, within=20, interval=0.05,
                         what="the reserve as Redis holds it")
    finally:
        await redis.aclose()
