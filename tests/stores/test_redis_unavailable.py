"""Redis unreachable: calls that need it fail fast with UNAVAILABLE and a clear message, and
the server recovers by itself when Redis comes back (a redis-server started by the test)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stargrpc.errors import Unavailable
from stargrpc.stores.redis.errors import reachable
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.helpers import free_port, status_details
from tests.runs_support import HeaderPrincipal, collect, execute_request, key, run_registry
from tests.stores.helpers import OwnRedis


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[OwnRedis]:
    redis = OwnRedis(free_port(), tmp_path)
    yield redis
    redis.stop()


async def test_redis_down_is_unavailable_fast_and_recovers_when_it_returns(
        make_server, own_redis: OwnRedis) -> None:
    server = await make_server(registry=run_registry(), interceptors=[HeaderPrincipal()],
                               redis_url=f"redis://127.0.0.1:{own_redis.port}/0",
                               redis_timeout_seconds=0.5)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        health = health_pb2_grpc.HealthStub(channel)

        async def echo() -> list[events_pb2.RunEvent]:
            return await collect(stub.Execute(
                execute_request("echo", {"text": "hi"}, idempotency_key=key()), timeout=20))

        with pytest.raises(grpc.aio.AioRpcError) as down:
            await echo()
        with pytest.raises(grpc.aio.AioRpcError) as watch_down:
            await collect(stub.WatchRun(tool_service_pb2.WatchRunRequest(run_id="x"),
                                        timeout=20))
        await own_redis.start()
        back = await echo()
        own_redis.stop()
        with pytest.raises(grpc.aio.AioRpcError) as down_again:
            await echo()
        # Redis is down: health says so once the replica has noticed (a PING or a write).
        watch = health.Watch(health_pb2.HealthCheckRequest())
        serving = await asyncio.wait_for(_until_not_serving(watch), 30)
        watch.cancel()
        await own_redis.start()
        back_again = await echo()

    for error in (down.value, watch_down.value, down_again.value):
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert "Redis" in (error.details() or "")
        assert status_details(error)[0].reason == "RUN_STORE_UNAVAILABLE"
    assert back[-1].result.output == "hi"
    assert back_again[-1].result.output == "hi"
    # NOT_SERVING came (within the bound): at most a SERVING before it, from before the
    # replica noticed.
    assert serving[:-1] in ([], [health_pb2.HealthCheckResponse.SERVING])


async def _until_not_serving(watch: grpc.aio.UnaryStreamCall) -> list[int]:
    """The statuses a health Watch sends up to the first NOT_SERVING."""
    seen: list[int] = []
    while not seen or seen[-1] != health_pb2.HealthCheckResponse.NOT_SERVING:
        answer = await watch.read()
        assert answer is not grpc.aio.EOF
        seen.append(answer.status)
    return seen


def test_a_call_that_timed_out_is_told_apart_from_a_lost_connection() -> None:
    # redis-py's cluster client can let a bare TimeoutError (an OSError) out of a command
    # that ran out of time: the caller is refused UNAVAILABLE either way, and the log says
    # which it was rather than "connection lost".
    for raised, said in ((TimeoutError(), "no answer in time"),
                         (ConnectionResetError("reset by peer"), "connection lost")):
        with pytest.raises(Unavailable) as refused, reachable("claim"):
            raise raised
        assert refused.value.reason == "RUN_STORE_UNAVAILABLE"
        assert said in str(refused.value.__cause__)
