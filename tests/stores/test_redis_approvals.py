"""Approval in a fleet: two replicas sharing Redis (and a Redis Cluster) — a run waiting
on one replica is listed, approved and denied from the other, and the decision reaches it;
the store's compare-and-set takes one decision of two racing ones."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import grpc
from redis.asyncio import Redis

from stargrpc.stores.approvals import (
    APPROVED,
    DECIDED,
    DENIED,
    ID_MISMATCH,
    NOT_PENDING,
    PENDING,
    ApprovalRecord,
    now_ms,
)
from stargrpc.stores.redis.approvals import RedisApprovalStore
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
from tests.procs import ServerProcess, server_env
from tests.runs_support import HeaderPrincipal, as_principal
from tests.stores.conftest import REDIS_URL, LoopbackCluster

ALICE = as_principal("alice")
BOB = as_principal("bob", "approver")


async def _stubs(make_server, url: str, prefix: str) -> tuple[list[Any], list[Any]]:
    servers = [await make_server(registry=approval_registry(),
                                 interceptors=[HeaderPrincipal()], redis_url=url,
                                 redis_key_prefix=prefix) for _ in range(2)]
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{s.port}") for s in servers]
    return channels, [tool_service_pb2_grpc.ToolServiceStub(c) for c in channels]


async def _approved_and_denied_across(stub_a, stub_b) -> None:
    """A run on A approved from B runs; another denied from B ends DENIED."""
    call = stub_a.Execute(execute_request("deploy", {"service": "api"}), metadata=ALICE)
    head, approval = await read_until_approval(call)
    run_id = head[0].run_id

    async def listed_on_b() -> list[tuple[str, str]]:
        listed = await stub_b.ListRuns(tool_service_pb2.ListRunsRequest(
            state=tool_service_pb2.RUN_STATE_AWAITING_APPROVAL), metadata=BOB)
        return [(r.run_id, r.approval.approval_id) for r in listed.runs]

    # The ListRuns index takes a run in with its replica's next flush, a moment after the
    # call was answered (by design: a listing may lag, a call must not wait for it); the
    # request itself is in Redis before the caller hears of it, so B could decide at once.
    assert await eventually(listed_on_b) == [(run_id, approval.approval_id)]
    await stub_b.ApproveRun(approve_request(run_id, approval.approval_id,
                                            digest=approval.arguments_digest), metadata=BOB)
    events = await rest_of(call)
    assert events[-1].result.output == "deployed api to staging"
    assert [e.notice.approval_decision.approver for e in events
            if e.notice.code == "APPROVAL_GRANTED"] == ["bob"]
    assert BODIES_RUN.count(run_id) == 1

    call = stub_a.Execute(execute_request("deploy", {"service": "db"}), metadata=ALICE)
    head, approval = await read_until_approval(call)
    await stub_b.ApproveRun(approve_request(head[0].run_id, approval.approval_id, deny=True,
                                            reason="freeze"), metadata=BOB)
    result = (await rest_of(call))[-1].result
    assert (result.outcome, result.error.code, result.error.message) == (
        events_pb2.OUTCOME_DENIED, "APPROVAL_DENIED", "denied by bob: freeze")
    assert head[0].run_id not in BODIES_RUN


async def test_a_decision_on_another_replica_reaches_the_run(make_server,
                                                             redis_prefix: str) -> None:
    channels, (stub_a, stub_b) = await _stubs(make_server, REDIS_URL, redis_prefix)
    try:
        await _approved_and_denied_across(stub_a, stub_b)
    finally:
        for channel in channels:
            await channel.close()


async def test_a_decision_reaches_the_run_on_a_redis_cluster(
        make_server, redis_cluster: LoopbackCluster) -> None:
    channels, (stub_a, stub_b) = await _stubs(make_server, redis_cluster.url, "stargrpc:")
    try:
        await _approved_and_denied_across(stub_a, stub_b)
    finally:
        for channel in channels:
            await channel.close()


async def test_two_racing_decisions_one_wins(redis_prefix: str) -> None:
    client = Redis.from_url(REDIS_URL)
    stores = [RedisApprovalStore(client, prefix=redis_prefix, poll_interval=0.05)
              for _ in range(2)]
    try:
        record = ApprovalRecord(run_id="r1", approval_id="the-id", tool="deploy",
                                owner="alice", principal="alice", digest="d" * 64,
                                arguments="{}", requested_ms=now_ms(),
                                deadline_ms=now_ms() + 60_000)
        await stores[0].put(record, 60_000)
        waiter = asyncio.ensure_future(stores[0].wait("r1", 30))
        assert (await stores[1].decide("r1", "other-id", "", APPROVED, "bob", ""))[0] == \
            ID_MISMATCH
        answers = await asyncio.gather(
            stores[1].decide("r1", "the-id", "", APPROVED, "bob", "yes"),
            stores[1].decide("r1", "the-id", "", DENIED, "carol", "no"))
        assert sorted(answer for answer, _ in answers) == [DECIDED, NOT_PENDING]
        decided = await asyncio.wait_for(waiter, 30)  # through the poll: another store
        assert decided is not None and decided.state != PENDING
        winner = next(found for answer, found in answers if answer == DECIDED)
        assert winner is not None and (decided.state, decided.approver) == (
            winner.state, winner.approver)
        assert await client.pttl(stores[0].key("r1")) > 0
    finally:
        for store in stores:
            await store.aclose()
        await client.aclose()


async def test_a_decision_acknowledged_survives_the_approvers_replica_killed_at_once(
        make_server, redis_prefix: str, tmp_path) -> None:
    # The replica that answered ApproveRun is SIGKILLed the instant after its answer: the
    # decision it acknowledged was already in Redis, so the run on the other replica runs.

    holder = await make_server(registry=approval_registry(), interceptors=[HeaderPrincipal()],
                               redis_url=REDIS_URL, redis_key_prefix=redis_prefix)
    approver = ServerProcess(["--redis-url", REDIS_URL],
                             server_env(tmp_path / "approver",
                                        STARGRPC_REDIS_KEY_PREFIX=redis_prefix))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{holder.port}") as channel, \
                grpc.aio.insecure_channel(approver.target) as other:
            call = tool_service_pb2_grpc.ToolServiceStub(channel).Execute(
                execute_request("deploy", {"service": "api"}), metadata=ALICE)
            head, approval = await read_until_approval(call)
            await tool_service_pb2_grpc.ToolServiceStub(other).ApproveRun(approve_request(
                head[0].run_id, approval.approval_id, digest=approval.arguments_digest),
                timeout=30)
            approver.signal(signal.SIGKILL)
            events = await rest_of(call)
    finally:
        approver.stop()
    assert events[-1].result.outcome == events_pb2.OUTCOME_OK, events[-1].result
    assert events[-1].result.output == "deployed api to staging"
    assert BODIES_RUN.count(head[0].run_id) == 1
