"""Approval on a Redis that stalls (SIGSTOP) rather than dies: a decision sent while Redis is
stopped is refused UNAVAILABLE within a bound (never taken as made), the run keeps waiting
without running its body, and once Redis resumes the same approval id decides it. The Redis
here is the test's own (never the shared one)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest

from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.approval.approval_helpers import (
    BODIES_RUN,
    approval_registry,
    approve_request,
    execute_request,
    read_until_approval,
    rest_of,
)
from tests.helpers import eventually
from tests.runs_support import HeaderPrincipal, as_principal
from tests.stores.conftest import StallableRedis

ALICE = as_principal("alice")
BOB = as_principal("bob", "approver")


async def test_a_decision_in_a_stall_is_refused_and_the_run_waits_for_the_next_one(
        stallable_redis: StallableRedis, make_server: Any, redis_prefix: str) -> None:
    servers = [await make_server(registry=approval_registry(), interceptors=[HeaderPrincipal()],
                                 redis_url=stallable_redis.url, redis_key_prefix=redis_prefix,
                                 redis_timeout_seconds=0.5, run_lease_seconds=2.0)
               for _ in range(2)]
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{s.port}") for s in servers]
    try:
        runner, approver = (tool_service_pb2_grpc.ToolServiceStub(c) for c in channels)
        call = runner.Execute(execute_request("deploy", {"service": "api"}), metadata=ALICE,
                              timeout=120)
        head, approval = await read_until_approval(call)
        run_id = head[0].run_id
        stallable_redis.stall()
        try:
            began = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as stalled:
                await asyncio.wait_for(approver.ApproveRun(
                    approve_request(run_id, approval.approval_id,
                                    digest=approval.arguments_digest),
                    metadata=BOB, timeout=30), 40)
            waited = time.monotonic() - began
        finally:
            stallable_redis.resume()
        assert stalled.value.code() == grpc.StatusCode.UNAVAILABLE, stalled.value
        assert waited < 20  # bounded by the store's timeouts, not by the call's deadline
        assert run_id not in BODIES_RUN
        # Redis is back: the run is still waiting (listed once the runs index written in the
        # stall is written again: best effort, by design), and the same approval decides it.
        async def waiting() -> list[str]:
            listed = await approver.ListRuns(tool_service_pb2.ListRunsRequest(
                state=tool_service_pb2.RUN_STATE_AWAITING_APPROVAL), metadata=BOB)
            return [r.run_id for r in listed.runs]

        assert await eventually(waiting, within=20, interval=0.1,
                                what="the run listed as awaiting approval") == [run_id]
        await approver.ApproveRun(approve_request(run_id, approval.approval_id,
                                                  digest=approval.arguments_digest),
                                  metadata=BOB, timeout=30)
        events = await rest_of(call)
        assert events[-1].result.outcome == events_pb2.OUTCOME_OK, events[-1].result
        assert events[-1].result.output == "deployed api to staging"
        assert BODIES_RUN.count(run_id) == 1
    finally:
        for channel in channels:
            await channel.close()
