"""A fleet replica's health follows its Redis: NOT_SERVING while Redis is stalled or down,
SERVING again when it answers, seen by Check and by Watch over a real channel, and on the
``stargrpc_run_store_reachable`` gauge; a shutdown's NOT_SERVING stays whatever Redis does; an
embedded server is SERVING with no Redis at all.
Each test stalls or kills a redis-server of its own, never the shared one."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from redis.asyncio.cluster import RedisCluster
from structlog.testing import capture_logs

from stargrpc import metrics
from stargrpc.contract import SERVICE_NAME
from stargrpc.server.grpc_server import LIVENESS_SERVICE, StargrpcServer
from stargrpc.stores.redis import RedisRunStore
from stargrpc.v1 import tool_service_pb2_grpc
from tests.runs_support import HeaderPrincipal, execute_request, key, run_registry
from tests.stores.conftest import LoopbackCluster, StallableRedis

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
WAIT = 60.0  # a bound on waits, never a claim about speed


async def _serve(make_server, url: str) -> StargrpcServer:
    server: StargrpcServer = await make_server(
        registry=run_registry(), interceptors=[HeaderPrincipal()], redis_url=url,
        redis_timeout_seconds=0.5, redis_ping_interval_seconds=0.2)
    return server


def _gauge() -> float | None:
    return metrics.REGISTRY.get_sample_value("stargrpc_run_store_reachable",
                                             {"store": "redis"})


async def _next(watch: grpc.aio.UnaryStreamCall) -> int:
    answer = await asyncio.wait_for(watch.read(), WAIT)
    assert answer is not grpc.aio.EOF
    return int(answer.status)


async def test_health_is_not_serving_while_redis_is_stalled_and_serving_when_it_resumes(
        make_server, stallable_redis: StallableRedis) -> None:
    server = await _serve(make_server, stallable_redis.url)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        first = await _next(watch)
        with capture_logs() as logs:
            stallable_redis.stall()
            try:
                stalled = await _next(watch)
                overall_stalled = await health.Check(health_pb2.HealthCheckRequest())
                alive = await health.Check(health_pb2.HealthCheckRequest(
                    service=LIVENESS_SERVICE))
                gauge_stalled = _gauge()
            finally:
                stallable_redis.resume()
            resumed = await _next(watch)
            overall_resumed = await health.Check(health_pb2.HealthCheckRequest())
            gauge_resumed = _gauge()
        watch.cancel()

    assert (first, stalled, resumed) == (SERVING, NOT_SERVING, SERVING)
    assert overall_stalled.status == NOT_SERVING
    assert alive.status == SERVING  # a restart would not bring Redis back
    assert overall_resumed.status == SERVING
    assert (gauge_stalled, gauge_resumed) == (0, 1)
    # One line for each change, however many PINGs and writes failed meanwhile.
    events = [line["event"] for line in logs if line["event"].startswith("run_store_")]
    assert events == ["run_store_unreachable", "run_store_reachable"]


async def test_health_is_not_serving_while_redis_is_down_and_serving_when_it_is_back(
        make_server, stallable_redis: StallableRedis) -> None:
    server = await _serve(make_server, stallable_redis.url)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        watches = [health.Watch(health_pb2.HealthCheckRequest(service=name))
                   for name in ("", SERVICE_NAME)]
        first = [await _next(watch) for watch in watches]
        stallable_redis.kill()
        down = [await _next(watch) for watch in watches]
        await stallable_redis.start()  # the same port, empty
        back = [await _next(watch) for watch in watches]
        for watch in watches:
            watch.cancel()

    assert (first, down, back) == ([SERVING] * 2, [NOT_SERVING] * 2, [SERVING] * 2)


async def test_a_replica_started_while_redis_is_down_is_not_serving_until_it_answers(
        make_server, stallable_redis: StallableRedis) -> None:
    stallable_redis.kill()
    server = await _serve(make_server, stallable_redis.url)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        first = await _next(watch)
        await stallable_redis.start()
        then = await _next(watch)
        watch.cancel()

    assert (first, then) == (NOT_SERVING, SERVING)


async def test_an_embedded_server_is_serving_without_any_redis(make_server) -> None:
    server = await make_server(registry=run_registry(), interceptors=[HeaderPrincipal()])
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        answers = [await health.Check(health_pb2.HealthCheckRequest(service=name))
                   for name in ("", SERVICE_NAME)]

    assert [answer.status for answer in answers] == [SERVING, SERVING]


async def test_shutdown_stays_not_serving_when_redis_answers_again(
        make_server, stallable_redis: StallableRedis, tmp_path: Path) -> None:
    server = await _serve(make_server, stallable_redis.url)
    store = server.runtime.store
    assert isinstance(store, RedisRunStore)
    gate = tmp_path / "gate"
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        first = await _next(watch)
        # A run in flight holds the drain (and the transport) open until the gate opens.
        run = tool_service_pb2_grpc.ToolServiceStub(channel).Execute(execute_request(
            "tally", {"path": str(tmp_path / "tally"), "gate": str(gate), "deltas": 0},
            idempotency_key=key()))
        await asyncio.wait_for(run.read(), WAIT)
        stopping = asyncio.create_task(server.stop(grace=WAIT))
        draining = await _next(watch)
        stallable_redis.stall()
        try:
            await asyncio.wait_for(store.reachability.changed(True), WAIT)
        finally:
            stallable_redis.resume()
        await asyncio.wait_for(store.reachability.changed(False), WAIT)  # Redis answers
        gate.touch()
        later: list[int] = []
        with contextlib.suppress(grpc.aio.AioRpcError):  # the stream ends with the server
            while (answer := await asyncio.wait_for(watch.read(), WAIT)) is not grpc.aio.EOF:
                later.append(answer.status)
        await asyncio.wait_for(stopping, WAIT)

    assert (first, draining) == (SERVING, NOT_SERVING)
    assert SERVING not in later


async def test_a_cluster_replica_is_not_serving_while_any_primary_is_stalled(
        make_server, redis_cluster: LoopbackCluster) -> None:
    server = await _serve(make_server, redis_cluster.url)
    store = server.runtime.store
    assert isinstance(store, RedisRunStore) and isinstance(store.redis, RedisCluster)
    # Not the node the client sends single-node commands to: every primary is looked at.
    default = store.redis.get_default_node()
    stalled = next(port for port in redis_cluster.primary_ports()
                   if default is None or port != default.port)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        first = await _next(watch)
        os.kill(redis_cluster.procs[stalled].pid, signal.SIGSTOP)
        try:
            down = await _next(watch)
        finally:
            os.kill(redis_cluster.procs[stalled].pid, signal.SIGCONT)
        back = await _next(watch)  # it answers again (or a replica took its slots over)
        watch.cancel()

    assert (first, down, back) == (SERVING, NOT_SERVING, SERVING)
