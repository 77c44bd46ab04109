"""Redis stream delivery on the shared Redis (a key prefix of the test's own): the Result
XADDed when the run ends, and still delivered when the replica running the run is killed
with SIGKILL (another replica takes the pending delivery over)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from redis.asyncio import Redis

from stargrpc.stores.connect import connect
from stargrpc.v1 import tool_service_pb2, tool_service_pb2_grpc
from tests.delivery.helpers import read_entry, start_request
from tests.helpers import eventually, status_details
from tests.procs import ServerProcess, server_env
from tests.runs_support import (
    RUN_TOOLS_DIR,
    HeaderPrincipal,
    as_principal,
    collect,
    execute_request,
    key,
    run_registry,
)
from tests.stores.conftest import REDIS_URL


async def test_the_result_is_added_to_the_stream(replicas, redis_prefix: str) -> None:
    server = await replicas()
    redis = Redis.from_url(REDIS_URL)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = tool_service_pb2_grpc.ToolServiceStub(channel)
            started = await stub.StartRun(start_request("echo", {"text": "hi"}, "results"))
            entry = await read_entry(redis, f"{redis_prefix}results", started.run_id, 20)

        async def none_pending() -> bool:
            return not await redis.hlen(f"{redis_prefix}delivery:pending")

        # Cleared by the delivery's task after its XADD, a round trip later: no event to await.
        await eventually(none_pending, within=10, interval=0.05, what="no delivery pending")
    finally:
        await redis.aclose()

    assert entry["outcome"] == "OUTCOME_OK" and entry["tool_name"] == "echo"
    assert json.loads(entry["result"])["output"] == "hi"


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


async def test_a_stream_named_after_a_key_of_the_store_is_refused(
        replicas, redis_prefix: str, tmp_path: Path) -> None:
    # The stream is XADDed under the key prefix, beside the run store's own keys: a caller
    # naming one of them wrote into another principal's run log (its watchers on other
    # replicas were told EVENTS_TRIMMED), or made the page token key a stream (every
    # ListRuns of the fleet UNAVAILABLE from then on).
    server = await replicas()
    redis = Redis.from_url(REDIS_URL)
    gate = tmp_path / "gate"
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = tool_service_pb2_grpc.ToolServiceStub(channel)
            call = stub.Execute(execute_request(
                "tally", {"path": str(tmp_path / "tally"), "gate": str(gate)},
                idempotency_key=key()), metadata=as_principal("alice"))
            victim = (await call.read()).event.run_id
            await stub.ListRuns(tool_service_pb2.ListRunsRequest(),
                                metadata=as_principal("alice"))
            delivered = await stub.StartRun(start_request("echo", {"text": "hi"}, "results"),
                                            metadata=as_principal("mallory"))
            await read_entry(redis, f"{redis_prefix}results", delivered.run_id, 20)
            names = [k.decode()[len(redis_prefix):]
                     async for k in redis.scan_iter(match=f"{redis_prefix}*", count=1000)]
            names = [n for n in names if n != "results"]
            named = [f"run:{victim}:events", "page-token-key", "runs:running",
                     "lane:default:queue", "delivery:pending"]
            refusals = []
            for stream in [*named, *names]:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.StartRun(start_request("echo", {"text": "evil"}, stream),
                                        metadata=as_principal("mallory"))
                refusals.append((stream, refused.value.code(), [
                    v.field for d in status_details(refused.value)
                    if isinstance(d, error_details_pb2.BadRequest)
                    for v in d.field_violations]))
            gate.touch()
            executed = await collect(call)
            watched = await collect(stub.WatchRun(
                tool_service_pb2.WatchRunRequest(run_id=victim),
                metadata=as_principal("alice")))
            await stub.ListRuns(tool_service_pb2.ListRunsRequest(),
                                metadata=as_principal("alice"))
        page_key_type = await redis.type(f"{redis_prefix}page-token-key")
    finally:
        await redis.aclose()

    assert {"run", "runs", "idem", "page-token-key"} <= {
        name.split(":")[0] for name in names}
    assert all(code == grpc.StatusCode.INVALID_ARGUMENT
               and fields == ["delivery.redis_stream.stream"]
               for _, code, fields in refusals), refusals
    assert executed[-1].HasField("result") and watched[-1].seq == executed[-1].seq
    assert page_key_type == b"string"


async def test_a_stream_keeps_only_its_newest_entries(replicas, redis_prefix: str) -> None:
    """Any caller may name a stream, and Redis holds it in memory: each delivery trims it to
    delivery_redis_stream_maxlen entries, the newest."""
    server = await replicas(delivery_redis_stream_maxlen=3)
    redis = Redis.from_url(REDIS_URL)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = tool_service_pb2_grpc.ToolServiceStub(channel)
            runs = [(await stub.StartRun(start_request("echo", {"text": str(n)}, "capped")
                                         )).run_id for n in range(5)]

            async def all_delivered() -> bool:
                # Each was pending before its StartRun was answered, until delivered.
                return await redis.hlen(f"{redis_prefix}delivery:pending") == 0

            await eventually(all_delivered, within=20, interval=0.05,
                             what="the five deliveries made")
            length = await redis.xlen(f"{redis_prefix}capped")
            kept = [entry[b"run_id"].decode()
                    for _, entry in await redis.xrange(f"{redis_prefix}capped")]
    finally:
        await redis.aclose()

    assert length == 3
    assert set(kept) <= set(runs)
