"""Concurrency limits (global, per principal, per tool) and the request-size limit."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from stargrpc.errors import ResourceExhausted
from stargrpc.runs.concurrency import ConcurrencyLimits
from stargrpc.v1 import events_pb2, tool_service_pb2_grpc
from tests.helpers import status_details
from tests.runs_support import HeaderPrincipal, as_principal, collect, execute_request, run_registry

ALICE = as_principal("alice")
BOB = as_principal("bob")


def test_each_limit_refuses_and_a_release_frees_the_place() -> None:
    limits = ConcurrencyLimits(total=3, per_principal=2, per_tool=2, retry_after=2.5)
    first = limits.acquire("alice", "t")
    limits.acquire("alice", "u")
    with pytest.raises(ResourceExhausted) as per_principal:
        limits.acquire("alice", "v")
    limits.acquire("bob", "t")
    with pytest.raises(ResourceExhausted) as total:
        limits.acquire("carol", "w")
    first.release()
    first.release()  # twice is harmless
    limits.acquire("carol", "w")

    assert per_principal.value.metadata["scope"] == "principal"
    assert total.value.metadata["scope"] == "server"
    assert per_principal.value.retry_after == 2.5
    assert limits.in_flight == 3


def test_places_come_back_one_by_one_and_no_count_outlives_its_runs() -> None:
    limits = ConcurrencyLimits(per_principal=2, per_tool=3)
    permits = [limits.acquire(f"p{i % 5}", f"t{i % 7}") for i in range(10)]
    with pytest.raises(ResourceExhausted):
        limits.acquire("p0", "t9")  # p0 holds two
    permits[0].release()
    permits[0].release()  # twice is harmless
    permits[0] = limits.acquire("p0", "t9")
    with pytest.raises(ResourceExhausted):
        limits.acquire("p0", "t9")

    for permit in permits:
        permit.release()
    assert limits.in_flight == 0
    # A stream of distinct principals and tools does not grow the counts.
    assert limits._by_principal == {} and limits._by_tool == {}
    again = [limits.acquire("p0", "t0"), limits.acquire("p0", "t0")]
    assert limits.in_flight == 2 and again[0] is not again[1]


def test_per_tool_limit() -> None:
    limits = ConcurrencyLimits(per_tool=1)
    limits.acquire("alice", "t")
    with pytest.raises(ResourceExhausted) as caught:
        limits.acquire("bob", "t")
    limits.acquire("bob", "u")

    assert caught.value.metadata == {"scope": "tool", "limit": "1"}


async def test_over_the_limit_is_resource_exhausted_with_retry_info(make_server,
                                                                   tmp_path: Path) -> None:
    server = await make_server(registry=run_registry(), interceptors=[HeaderPrincipal()],
                               max_concurrent_runs_per_tool=1, limit_retry_after_seconds=3)
    gate = tmp_path / "gate"
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        running = stub.Execute(execute_request(
            "tally", {"path": str(tmp_path / "t"), "gate": str(gate)}), metadata=ALICE)
        await running.read()
        runs_before = len(server.runtime.store)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await collect(stub.Execute(execute_request(
                "tally", {"path": str(tmp_path / "t")}), metadata=BOB))
        runs_after_refusal = len(server.runtime.store)
        other_tool = await collect(stub.Execute(execute_request("echo", {"text": "x"}),
                                                metadata=BOB))
        gate.touch()
        await collect(running)
        after = await collect(stub.Execute(execute_request(
            "tally", {"path": str(tmp_path / "t")}), metadata=BOB))

    details = status_details(caught.value)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert details[0].retry_delay.seconds == 3
    assert details[1].reason == "CONCURRENCY_LIMIT"
    assert other_tool[-1].result.outcome == events_pb2.OUTCOME_OK
    assert after[-1].result.outcome == events_pb2.OUTCOME_OK
    assert runs_after_refusal == runs_before  # a refused call leaves no run behind


async def test_a_request_over_the_size_limit_is_refused_clearly(make_server) -> None:
    server = await make_server(max_receive_message_bytes=64 * 1024)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await collect(stub.Execute(execute_request("echo", {"text": "x" * 100_000})))
        normal = await collect(stub.Execute(execute_request("echo", {"text": "x"})))

    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in (caught.value.details() or "")
    assert normal[-1].result.output == "x"
