"""Redis stream delivery on the shared Redis (a key prefix of the test's own): the Result
XADDed when the run ends, and still delivered when the replica running the run is killed
with SIGKILL (another replica takes the pending delivery over)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import grpc
from redis.asyncio import Redis

from stargrpc.stores.connect import connect
from stargrpc.v1 import tool_service_pb2_grpc
from tests.delivery.helpers import read_entry, start_request
from tests.helpers import eventually
from tests.procs import ServerProcess, server_env
from tests.runs_support import RUN_TOOLS_DIR, HeaderPrincipal, run_registry
from tests.stores.conftest import REDIS_URL


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

        async def pending_and_stored() -> bool:
            return bool(await redis.hexists(pending_key, started.run_id) and await redis.exists(
                f"{redis_prefix}run:{started.run_id}"))

        # The delivery is pending and the run is in Redis (its first events flushed): another
        # process writes them, there is no event to await.
        await eventually(pending_and_stored, within=20, interval=0.05,
                         what="the delivery pending and the run in Redis")
        doomed.signal(signal.SIGKILL)
        await replicas(run_lease_seconds=1)  # the survivor
        entry = await read_entry(redis, f"{redis_prefix}results", started.run_id, 60)

        async def delivered() -> bool:
            return not await redis.hexists(pending_key, started.run_id)

        await eventually(delivered, within=10, interval=0.05, what="the delivery no more pending")
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

        async def none_pending() -> bool:
            return not await client.hlen(f"{redis_prefix}delivery:pending")

        # Written by the delivery's task: no event to await.
        await eventually(none_pending, within=10, interval=0.05, what="no delivery pending")
    finally:
        await client.aclose()

    assert entry["outcome"] == "OUTCOME_OK"
    assert json.loads(entry["result"])["output"] == "hi"
