"""Run state shared by replicas, on one Redis and on a Redis Cluster: a tree's keys sit in
one hash slot, and read-modify-write loops of compare_and_set from two replicas on one key
lose no update (each store, and each server process, sees the other's writes at once)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
from redis.crc import key_slot

from stargrpc.runs.state import RunState
from stargrpc.settings import Settings
from stargrpc.stores.connect import connect
from stargrpc.stores.redis.state import RedisStateStore
from stargrpc.v1 import tool_service_pb2_grpc
from tests.runs_support import HeaderPrincipal
from tests.state_tools import call_state_tool, state_registry, value_of
from tests.stores.conftest import REDIS_URL, LoopbackCluster


async def _cas_add(state: RunState, key: str, times: int) -> int:
    """Adds 1 to ``key`` ``times`` times by read, then compare_and_set; the attempts lost."""
    lost = 0
    for _ in range(times):
        while True:
            old = await state.get(key)
            if await state.compare_and_set(key, old, (old or 0) + 1):
                break
            lost += 1
    return lost


async def test_read_modify_write_from_two_replicas_loses_no_update(
        redis_prefix: str) -> None:
    await _read_modify_write(REDIS_URL, redis_prefix)


async def test_read_modify_write_from_two_replicas_loses_no_update_on_a_cluster(
        redis_cluster: LoopbackCluster, redis_prefix: str) -> None:
    await _read_modify_write(redis_cluster.url, redis_prefix)


async def _read_modify_write(shared_url: str, redis_prefix: str) -> None:
    clients = [connect(shared_url, timeout=5.0)[0] for _ in range(2)]
    stores = [RedisStateStore(client, prefix=redis_prefix) for client in clients]
    settings = Settings(insecure_no_auth=True)
    try:
        name = "tree:root-of-the-tree"
        assert len({key_slot(k.encode()) for k in stores[0].scope_keys(name)}) == 1
        states = [RunState(store, "tree", name, settings, writable=True) for store in stores]
        # Eight siblings, four on each replica, each adding 10.
        await asyncio.gather(*(_cas_add(states[i % 2], "total", 10) for i in range(8)))
        assert await states[0].get("total") == await states[1].get("total") == 80
        # An increment from each replica on the same key: atomic too.
        await asyncio.gather(*(states[i % 2].increment("total", 1) for i in range(20)))
        assert await states[1].get("total") == 100
    finally:
        for client in clients:
            await client.aclose()


async def test_two_server_replicas_share_state(make_server, redis_prefix: str) -> None:
    await _two_servers(make_server, REDIS_URL, redis_prefix)


async def test_two_server_replicas_share_state_on_a_cluster(
        make_server, redis_cluster: LoopbackCluster, redis_prefix: str) -> None:
    await _two_servers(make_server, redis_cluster.url, redis_prefix)


async def _two_servers(make_server: Any, shared_url: str, redis_prefix: str) -> None:
    stubs = []
    for _ in range(2):
        server = await make_server(registry=state_registry(), interceptors=[HeaderPrincipal()],
                                   redis_url=shared_url, redis_key_prefix=redis_prefix)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        stubs.append(tool_service_pb2_grpc.ToolServiceStub(channel))
    results = await asyncio.gather(*(
        call_state_tool(stubs[i % 2], scope="principal", op="cas", key="leader",
                        expected=None, value=f"run-{i}") for i in range(10)))
    winners = [i for i, result in enumerate(results) if value_of(result) is True]
    assert len(winners) == 1
    leader = value_of(await call_state_tool(stubs[1 - winners[0] % 2], scope="principal",
                                            op="get", key="leader"))
    assert leader == f"run-{winners[0]}"
    counted = await asyncio.gather(*(
        call_state_tool(stubs[i % 2], "state_op_sync", scope="principal", op="increment",
                        key="hits", repeat=5) for i in range(6)))
    assert sorted(json.loads(r.output)["value"] for r in counted)[-1] == 30
