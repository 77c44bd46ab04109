"""The server as a process: SIGTERM drains, the catalog hash is the same everywhere, the
garbage collector is settled for serving."""

from __future__ import annotations

import asyncio
import gc
import signal
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stargrpc.server.grpc_server import GC_THRESHOLDS, tune_garbage_collector
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.procs import serve


async def test_sigterm_lets_the_inflight_run_finish_and_exits_zero(tmp_path: Path) -> None:
    with serve(tmp_path) as server:
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = tool_service_pb2_grpc.ToolServiceStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            request = tool_service_pb2.ExecuteRequest(
                tool_name="count", arguments_json='{"to": 6, "delay": 0.25}')
            call = stub.Execute(request)
            events = [(await call.read()).event]  # the run has started
            server.signal(signal.SIGTERM)
            server_side = await asyncio.to_thread(
                server.wait_for, lambda line: line.get("event") == "shutting_down", 10)
            assert server_side["runs_in_flight"] == 1
            status = await health.Check(health_pb2.HealthCheckRequest(service=""))
            assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with_new_call = stub.Execute(tool_service_pb2.ExecuteRequest(
                tool_name="echo", arguments_json='{"text": "late"}'))
            try:
                await with_new_call.read()
                raise AssertionError("a new call was accepted while draining")
            except grpc.aio.AioRpcError as error:
                assert error.code() == grpc.StatusCode.UNAVAILABLE
            while (response := await call.read()) is not grpc.aio.EOF:
                events.append(response.event)
        assert events[-1].result.outcome == events_pb2.OUTCOME_OK
        assert events[-1].result.output == "counted to 6"
        assert await asyncio.to_thread(server.proc.wait, 20) == 0


async def test_catalog_hash_is_the_same_in_two_processes(tmp_path: Path) -> None:
    hashes = []
    for name in ("a", "b"):
        with serve(tmp_path / name) as server:
            async with grpc.aio.insecure_channel(server.target) as channel:
                stub = tool_service_pb2_grpc.ToolServiceStub(channel)
                reply = await stub.ListTools(tool_service_pb2.ListToolsRequest())
                hashes.append(reply.catalog_hash)
                assert {"count", "echo", "sleep"} <= {t.name for t in reply.tools}
    assert hashes[0] == hashes[1]
    assert hashes[0].startswith("sha256:")


def test_a_serving_process_settles_its_garbage_collector() -> None:
    thresholds = gc.get_threshold()
    try:
        tune_garbage_collector()
        assert gc.get_threshold() == GC_THRESHOLDS
        assert gc.get_freeze_count() > 0  # what start-up loaded is out of the collector's way
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
