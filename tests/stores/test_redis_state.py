"""Run state in Redis (stores/redis/state.py): two replicas racing compare_and_set on one
key (exactly one wins), increments atomic under concurrency, quotas counted in Redis, run
state expiring after the run ends, and a Redis Cluster serving each scope in one slot."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from stargrpc.stores.base import STATE_MISMATCH, STATE_OVER_QUOTA, STATE_WRITTEN, StateWrite
from stargrpc.stores.connect import connect
from stargrpc.stores.redis.state import RedisStateStore
from stargrpc.v1 import tool_service_pb2_grpc
from tests.helpers import eventually
from tests.runs_support import HeaderPrincipal
from tests.state_tools import call_state_tool as state_call
from tests.state_tools import state_registry, value_of
from tests.stores.conftest import REDIS_URL, LoopbackCluster


async def _two_replicas(make_server: Any, prefix: str, **settings: Any) -> list[Any]:
    stubs = []
    for _ in range(2):
        server = await make_server(registry=state_registry(), interceptors=[HeaderPrincipal()],
                                   redis_url=REDIS_URL, redis_key_prefix=prefix, **settings)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        stubs.append(tool_service_pb2_grpc.ToolServiceStub(channel))
    return stubs


async def test_two_replicas_race_compare_and_set_and_exactly_one_wins(
        make_server, redis_prefix: str) -> None:
    stubs = await _two_replicas(make_server, redis_prefix)
    for round_, expected in enumerate([None, "start"]):
        if expected is not None:
            await state_call(stubs[0], scope="principal", op="set", key=f"lock{round_}",
                        value=expected)
        results = await asyncio.gather(*(
            state_call(stubs[i % 2], "state_op" if i % 3 else "state_op_sync", scope="principal",
                  op="cas", key=f"lock{round_}", expected=expected, value=f"winner-{i}")
            for i in range(20)))
        won = [i for i, result in enumerate(results) if value_of(result) is True]
        assert len(won) == 1, won
        assert value_of(await state_call(stubs[1], scope="principal", op="get",
                                  key=f"lock{round_}")) == f"winner-{won[0]}"


async def test_increments_from_two_replicas_are_atomic(make_server, redis_prefix: str) -> None:
    stubs = await _two_replicas(make_server, redis_prefix)
    await asyncio.gather(*(
        state_call(stubs[i % 2], "state_op" if i % 2 else "state_op_sync", scope="principal",
              op="increment", key="hits", repeat=25) for i in range(8)))
    assert value_of(await state_call(stubs[0], scope="principal", op="get", key="hits")) == 200


async def test_quota_and_value_size_are_refused_in_redis(make_server, redis_prefix: str) -> None:
    stubs = await _two_replicas(make_server, redis_prefix, state_max_bytes_per_scope=100,
                                state_max_value_bytes=90)
    assert value_of(await state_call(stubs[0], scope="principal", op="set", key="a",
                              value="x" * 80)) is None
    refused = await state_call(stubs[1], scope="principal", op="set", key="b", value="y" * 30)
    assert refused.error.code == "STATE_QUOTA_EXCEEDED"
    too_big = await state_call(stubs[1], scope="principal", op="set", key="c", value="z" * 100)
    assert too_big.error.code == "STATE_VALUE_TOO_LARGE"
    assert value_of(await state_call(stubs[1], scope="principal", op="delete", key="a")) is True
    assert value_of(await state_call(stubs[0], scope="principal", op="set", key="b",
                              value="y" * 30)) is None
    not_integer = await state_call(stubs[0], scope="principal", op="increment", key="b")
    assert not_integer.error.code == "STATE_NOT_INTEGER"


async def test_run_state_expires_after_the_run_ends(make_server, redis_prefix: str) -> None:
    stubs = await _two_replicas(make_server, redis_prefix, state_retention_seconds=0.5)
    client = Redis.from_url(REDIS_URL)
    try:
        await state_call(stubs[0], scope="principal", op="set", key="kept", value=1)
        result = await state_call(stubs[0], "state_run_and_tree")
        run_id = json.loads(result.output)["id"]
        run_key = f"{redis_prefix}state:{{run:{run_id}}}"
        tree_key = f"{redis_prefix}state:{{tree:{run_id}}}"

        async def ending() -> bool:
            # The run's end cut the TTL from the running bound (days) to the retention.
            return 0 < await client.pttl(run_key) <= 500 and \
                0 < await client.pttl(tree_key) <= 500

        await eventually(ending, what="the run's end to set its state's retention")

        async def gone() -> bool:
            return not await client.exists(run_key, tree_key)

        await eventually(gone, what="the run's state to expire")
        # The principal's state has no end of its own.
        principal_key = f"{redis_prefix}state:{{principal:alice}}"
        assert await client.pttl(principal_key) == -1
    finally:
        await client.aclose()


async def test_a_running_scope_is_bounded_and_expired_entries_free_the_quota(
        redis_prefix: str) -> None:
    client = Redis.from_url(REDIS_URL)
    store = RedisStateStore(client, prefix=redis_prefix)
    try:
        bounded = StateWrite(scope_ttl_ms=60_000, max_scope_bytes=20, ttl_ms=50)
        assert await store.put("run:r1", "a", '"' + "x" * 10 + '"', bounded) == STATE_WRITTEN
        assert 0 < await client.pttl(store.scope_keys("run:r1")[0]) <= 60_000
        full = StateWrite(scope_ttl_ms=60_000, max_scope_bytes=20)

        async def room() -> bool:  # once "a" expires, its bytes are reclaimed
            return await store.put("run:r1", "b", '"' + "y" * 10 + '"', full) == STATE_WRITTEN

        await eventually(room, what="the expired entry to free the quota")
        assert await store.get("run:r1", "a") is None
        assert await store.keys("run:r1", "") == ["b"]
        assert await store.put("run:r1", "c", '"zzzzzzzzzzzz"', full) == STATE_OVER_QUOTA
    finally:
        await client.aclose()


async def test_a_cluster_serves_each_scope_atomically_in_one_slot(
        redis_cluster: LoopbackCluster) -> None:
    clients = [connect(redis_cluster.url, timeout=2.0)[0] for _ in range(2)]
    assert all(isinstance(client, RedisCluster) for client in clients)
    stores = [RedisStateStore(client, prefix="stargrpc:") for client in clients]
    try:
        for scope in ("run:r1", "tree:r1", "principal:alice", "global"):
            assert len({key_slot(k.encode()) for k in stores[0].scope_keys(scope)}) == 1
        write = StateWrite(max_scope_bytes=10_000)

        async def bump(i: int) -> None:
            for _ in range(10):
                await stores[i % 2].increment("tree:r1", "n", 1, write)

        await asyncio.gather(*(bump(i) for i in range(10)))
        assert await stores[1].get("tree:r1", "n") == "100"
        outcomes = await asyncio.gather(*(
            stores[i % 2].put("principal:alice", "lock", f'"{i}"', write, conditional=True)
            for i in range(20)))
        assert outcomes.count(STATE_WRITTEN) == 1
        assert outcomes.count(STATE_MISMATCH) == 19
    finally:
        for client in clients:
            await client.aclose()


@pytest.mark.parametrize("scope", ["run:r1", "global"])
async def test_keys_and_delete_count_the_quota_back(redis_prefix: str, scope: str) -> None:
    client = Redis.from_url(REDIS_URL)
    store = RedisStateStore(client, prefix=redis_prefix)
    try:
        write = StateWrite(max_scope_bytes=8)
        assert await store.put(scope, "ab", '"xy"', write) == STATE_WRITTEN  # 2 + 4 bytes
        assert await store.put(scope, "cd", '"xy"', write) == STATE_OVER_QUOTA
        assert await store.delete(scope, "ab") is True
        assert await store.put(scope, "cd", '"xy"', write) == STATE_WRITTEN
        assert await client.get(store.scope_keys(scope)[2]) == b"6"
    finally:
        await client.aclose()
