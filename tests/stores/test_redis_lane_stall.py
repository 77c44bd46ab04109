"""Lanes on a Redis that stalls (SIGSTOP) rather than dies: a call that needs a lane slot
while Redis is stopped is refused UNAVAILABLE within a bound (it neither hangs nor runs
unadmitted), and once Redis resumes the lane admits and runs calls again, its slot given
back. The Redis here is the test's own (never the shared one)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest

from stargrpc.v1 import events_pb2, tool_service_pb2_grpc
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
