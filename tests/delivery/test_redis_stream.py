"""Redis stream delivery on the shared Redis (a key prefix of the test's own): the Result
XADDed when the run ends, and still delivered when the replica running the run is killed
with SIGKILL (another replica takes the pending delivery over)."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import grpc
from redis.asyncio import Redis

from stargrpc.stores.connect import connect
from stargrpc.v1 import tool_service_pb2, tool_service_pb2_grpc
from tests.procs import ServerProcess, server_env
from tests.runs_support import RUN_TOOLS_DIR, HeaderPrincipal, run_registry
from tests.stores.conftest import REDIS_URL


def start_request(tool_name: str, arguments: dict, stream: str
                  ) -> tool_service_pb2.StartRunRequest:
    request = tool_service_pb2.StartRunRequest(tool_name=tool_name,
                                               arguments_json=json.dumps(arguments))
    request.delivery.redis_stream.stream = stream
    return request


async def read_entry(redis: Redis, key: str, run_id: str, within: float) -> dict:
    """The first entry of stream ``key`` for ``run_id``, waited for (bounded)."""
    last = "0-0"
    async with asyncio.timeout(within):
        while True:
            reply = await redis.xread({key: last}, count=10, block=500)
            for _, entries in reply:
                for entry_id, fields in entries:
                    last = entry_id
                    decoded = {k.decode(): v.decode() for k, v in fields.items()}
                    if decoded["run_id"] == run_id:
                        return decoded


async def test_the_result_is_added_to_the_stream(replicas, redis_prefix: str) -> None:
    server = await replicas()
    redis = Redis.from_url(REDIS_URL)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = tool_service_pb2_grpc.ToolServiceStub(channel)
            started = await stub.StartRun(start_request("echo", {"text": "hi"}, "results"))
            entry = await read_entry(redis, f"{redis_prefix}results", started.run_id, 20)
        pending = await redis.hlen(f"{redis_prefix}delivery:pending")
    finally:
        await redis.aclose()

    assert entry["outcome"] == "OUTCOME_OK" and entry["tool_name"] == "echo"
    assert json.loads(entry["result"])["output"] == "hi"
    assert pending == 0


async def test_a_delivery_survives_a_sigkill_of_the_replica_running_the_run(
        replicas, redis_prefix: str, tmp_path: Path) -> None:
    doomed = ServerProcess(
        ["--tools-dir", str(RUN_TOOLS_DIR), "--redis-url", REDIS_URL],
        server_env(tmp_path / "a", STARGRPC_REDIS_KEY_PREFIX=redis_prefix,
                   STARGRPC_RUN_LEASE_SECONDS="1"))
    redis = Redis.from_url(REDIS_URL)
    try:
        async with grpc.aio.insecure_channel(doomed.target) as channel:
            stub = tool_service_pb2_grpc.ToolServiceStub(channel)
            started = await stub.StartRun(start_request(
                "tally", {"path": str(tmp_path / "tally"), "gate": str(tmp_path / "never")},
                "results"))
        pending_key = f"{redis_prefix}delivery:pending"
        async with asyncio.timeout(20):
            # The delivery is pending and the run is in Redis (its first events flushed).
            while not (await redis.hexists(pending_key, started.run_id) and await redis.exists(  # noqa: ASYNC110
                    f"{redis_prefix}run:{started.run_id}")):
                # Another process writes them: there is no event to await.
                await asyncio.sleep(0.05)
        doomed.signal(signal.SIGKILL)
        await replicas(run_lease_seconds=1)  # the survivor
        entry = await read_entry(redis, f"{redis_prefix}results", started.run_id, 60)
        async with asyncio.timeout(10):
            while await redis.hexists(pending_key, started.run_id):  # noqa: ASYNC110
                await asyncio.sleep(0.05)
    finally:
        doomed.stop()
        await redis.aclose()

    assert entry["outcome"] == "OUTCOME_ERROR"
    assert json.loads(entry["result"])["error"]["code"] == "RUN_LOST"


async def test_the_result_is_added_to_a_stream_of_a_redis_cluster(
        make_server, redis_cluster, redis_prefix: str) -> None:
    # The pending delivery and its lease live in other slots than the run: they are
    # registered apart (no transaction spans slots).
    server = await make_server(registry=run_registry(), interceptors=[HeaderPrincipal()],
                               redis_url=redis_cluster.url, redis_key_prefix=redis_prefix)
    client, _ = connect(redis_cluster.url, timeout=2.0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = tool_service_pb2_grpc.ToolServiceStub(channel)
            started = await stub.StartRun(start_request("echo", {"text": "hi"}, "results"))
            entry = await read_entry(client, f"{redis_prefix}results", started.run_id, 20)
        async with asyncio.timeout(10):
            while await client.hlen(f"{redis_prefix}delivery:pending"):  # noqa: ASYNC110
                await asyncio.sleep(0.05)  # written by the delivery's task: no event to await
    finally:
        await client.aclose()

    assert entry["outcome"] == "OUTCOME_OK"
    assert json.loads(entry["result"])["output"] == "hi"
