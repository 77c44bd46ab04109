"""Call trees across two replicas sharing Redis (one Redis, and a Redis Cluster): a child an
agent hangs (``parent_run_id``) on replica B under a root running on replica A joins the
root's tree (the run index carries parent and root), and cancelling the root on A cancels
the child on B and the child's own children there."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest

from stargrpc.registry import Registry
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.helpers import eventually, status_details
from tests.runs_support import HeaderPrincipal, as_principal
from tests.state_tools import state_registry, value_of
from tests.stores.conftest import REDIS_URL
from tests.tree_tools import GATES, tree_registry

ALICE = as_principal("alice")


async def _tree(stub: Any, root: str) -> list[tool_service_pb2.RunSummary]:
    reply = await stub.ListRuns(tool_service_pb2.ListRunsRequest(root_run_id=root),
                                metadata=ALICE)
    return list(reply.runs)


async def _start(stub: Any, arguments: dict[str, Any], parent: str = "") -> str:
    started = await stub.StartRun(tool_service_pb2.StartRunRequest(
        tool_name="tree_node", arguments_json=json.dumps(arguments), parent_run_id=parent),
        metadata=ALICE)
    return str(started.run_id)


@asynccontextmanager
async def _replicas(make_server: Any, url: str, prefix: str, **settings: Any) -> AsyncIterator[
        tuple[list[Any], tool_service_pb2_grpc.ToolServiceStub,
              tool_service_pb2_grpc.ToolServiceStub]]:
    """Replicas A and B on ``url`` under ``prefix``, and a stub of each."""
    servers = [await make_server(registry=tree_registry(), interceptors=[HeaderPrincipal()],
                                 redis_url=url, redis_key_prefix=prefix, **settings)
               for _ in range(2)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{servers[0].port}") as chan_a, \
            grpc.aio.insecure_channel(f"127.0.0.1:{servers[1].port}") as chan_b:
        yield (servers, tool_service_pb2_grpc.ToolServiceStub(chan_a),
               tool_service_pb2_grpc.ToolServiceStub(chan_b))


@pytest.fixture(params=["redis", "cluster"])
def redis_url(request: pytest.FixtureRequest) -> str:
    """One Redis, then a Redis Cluster of the test's own."""
    if request.param == "redis":
        return REDIS_URL
    return str(request.getfixturevalue("redis_cluster").url)


async def test_cancelling_a_root_on_one_replica_cancels_its_subtree_on_another(
        make_server: Any, redis_prefix: str, redis_url: str) -> None:
    async with _replicas(make_server, redis_url, redis_prefix) as (servers, a, b):
        root = await _start(a, {"levels": 0, "hold": True})
        # On B, under A's root: a node whose two children (ctx.call) run on B too.
        child = await _start(b, {"levels": 1, "fan_out": 2, "hold": True}, parent=root)
        assert child in servers[1].runtime.runs and root in servers[0].runtime.runs

        async def whole_tree() -> bool:
            runs = await _tree(a, root)
            return len(runs) == 4 and all(run.last_seq for run in runs)

        await eventually(whole_tree, what="the tree, listed from A")
        listed = {run.run_id: run for run in await _tree(a, root)}
        assert (listed[child].parent_run_id, listed[child].root_run_id,
                listed[child].depth) == (root, root, 1)
        grandchildren = [run for run in listed.values() if run.parent_run_id == child]
        assert len(grandchildren) == 2
        assert all((run.root_run_id, run.depth) == (root, 2) for run in grandchildren)
        assert listed[root].depth == 0 and listed[root].root_run_id == root

        reply = await a.CancelRun(tool_service_pb2.CancelRunRequest(run_id=root),
                                  metadata=ALICE)
        assert reply.cancelled

        async def all_ended() -> bool:
            return all(run.state == tool_service_pb2.RUN_STATE_FINISHED
                       for run in await _tree(a, root))

        await eventually(all_ended, what="every run of the tree ended, on both replicas")
        assert {run.outcome for run in await _tree(a, root)} == {events_pb2.OUTCOME_CANCELLED}
        # The child's own log (read from A) ends CANCELLED, and says where it sat.
        watched = [r.event async for r in a.WatchRun(
            tool_service_pb2.WatchRunRequest(run_id=child), metadata=ALICE)]
        assert watched[0].parent_run_id == root
        assert watched[-1].result.outcome == events_pb2.OUTCOME_CANCELLED


async def test_a_root_that_ends_on_one_replica_cancels_its_child_on_another(
        make_server: Any, redis_prefix: str) -> None:
    async with _replicas(make_server, REDIS_URL, redis_prefix) as (servers, a, b):
        name = uuid.uuid4().hex
        GATES[name] = asyncio.Event()
        started = await a.StartRun(tool_service_pb2.StartRunRequest(
            tool_name="gate", arguments_json=json.dumps({"name": name})), metadata=ALICE)
        root = started.run_id
        child = await _start(b, {"levels": 0, "hold": True}, parent=root)
        assert child in servers[1].runtime.runs
        GATES.pop(name).set()  # the root ends OK on A, its child still holding on B
        watched = [r.event async for r in b.WatchRun(
            tool_service_pb2.WatchRunRequest(run_id=child), metadata=ALICE)]
        assert watched[-1].result.outcome == events_pb2.OUTCOME_CANCELLED
        assert watched[-1].result.error.code == "PARENT_RUN_ENDED"
        rooted = [r.event async for r in a.WatchRun(
            tool_service_pb2.WatchRunRequest(run_id=root), metadata=ALICE)]
        assert rooted[-1].result.outcome == events_pb2.OUTCOME_OK


async def test_a_tree_spread_over_replicas_keeps_to_max_runs_per_tree_as_a_whole(
        make_server: Any, redis_prefix: str) -> None:
    async with _replicas(make_server, REDIS_URL, redis_prefix,
                         max_runs_per_tree=2) as (_, a, b):
        root = await _start(a, {"levels": 0, "hold": True})
        await _start(b, {"levels": 0, "hold": True}, parent=root)  # the tree's first run
        await _start(a, {"levels": 0, "hold": True}, parent=root)  # and its second
        # A has counted one run of the tree, B one: only the fleet's count refuses a third.
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await _start(a, {"levels": 0, "hold": True}, parent=root)
        assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "RUN_TREE_FULL" in str(status_details(caught.value))
        await eventually(lambda: _listed(a, root, 3), what="the tree's three runs listed")
        await a.CancelRun(tool_service_pb2.CancelRunRequest(run_id=root), metadata=ALICE)


async def _listed(stub: Any, root: str, count: int) -> bool:
    return len(await _tree(stub, root)) == count


async def test_siblings_on_two_replicas_coordinate_through_their_tree_state(
        make_server: Any, redis_prefix: str, redis_url: str) -> None:
    """Runs an agent hangs under one root, half on replica A and half on B, race to claim
    one key of the tree's state: exactly one wins, every sibling reads the winner, and a
    counter all of them increment loses no update."""
    registry = Registry([*tree_registry().values(), *state_registry().values()])
    servers = [await make_server(registry=registry, interceptors=[HeaderPrincipal()],
                                 redis_url=redis_url, redis_key_prefix=redis_prefix)
               for _ in range(2)]
    gate_name = uuid.uuid4().hex
    async with grpc.aio.insecure_channel(f"127.0.0.1:{servers[0].port}") as chan_a, \
            grpc.aio.insecure_channel(f"127.0.0.1:{servers[1].port}") as chan_b:
        stubs = [tool_service_pb2_grpc.ToolServiceStub(chan) for chan in (chan_a, chan_b)]
        root = str((await stubs[0].StartRun(tool_service_pb2.StartRunRequest(
            tool_name="gate", arguments_json=json.dumps({"name": gate_name})),
            metadata=ALICE)).run_id)

        async def sibling(index: int, **arguments: Any) -> events_pb2.Result:
            request = tool_service_pb2.ExecuteRequest(
                tool_name="state_op", arguments_json=json.dumps({"scope": "tree", **arguments}),
                parent_run_id=root)
            events = [r.event async for r in stubs[index % 2].Execute(request, metadata=ALICE)]
            return events[-1].result

        claims = await asyncio.gather(*(sibling(i, op="cas", key="owner", expected=None,
                                                value=f"sibling-{i}") for i in range(8)))
        winners = [i for i, result in enumerate(claims) if value_of(result) is True]
        assert len(winners) == 1
        reads = await asyncio.gather(*(sibling(i, op="get", key="owner") for i in range(2)))
        assert {value_of(result) for result in reads} == {f"sibling-{winners[0]}"}
        counts = await asyncio.gather(*(sibling(i, op="increment", key="seen", repeat=5)
                                        for i in range(6)))
        assert max(value_of(result) for result in counts) == 30
        # The siblings ran on both replicas, each in the root's tree.
        listed = await _tree(stubs[0], root)
        assert len(listed) == 1 + 8 + 2 + 6
        assert {run.root_run_id for run in listed} == {root}
        GATES.setdefault(gate_name, asyncio.Event()).set()
