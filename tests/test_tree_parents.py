"""``parent_run_id`` on Execute and StartRun (authentication on): an agent hangs a call under
one of its own runs, and every hostile parent is refused precisely and audited — another
principal's run, a finished run, malformed and oversized ids, a tree at its depth cap and
at its size cap — while the server keeps serving."""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest

from stargrpc.server.interceptors.audit import AuditInterceptor
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.helpers import eventually, key_channel, status_details
from tests.tree_tools import tree_registry

_HOLD = json.dumps({"levels": 0, "hold": True})


def _execute(tool: str, arguments: dict[str, Any], parent: str) -> Any:
    return tool_service_pb2.ExecuteRequest(tool_name=tool, arguments_json=json.dumps(arguments),
                                           parent_run_id=parent)


async def _refusal(stub: Any, request: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in stub.Execute(request):
            pass
    infos = [d for d in status_details(caught.value) if hasattr(d, "reason")]
    return caught.value.code(), infos[0].reason if infos else ""


async def _start_holding(stub: Any, parent: str = "") -> str:
    started = await stub.StartRun(tool_service_pb2.StartRunRequest(
        tool_name="tree_node", arguments_json=_HOLD, parent_run_id=parent))
    return str(started.run_id)


@pytest.fixture
async def agents(make_auth_server: Any) -> Any:
    """Alice's and Bob's stubs on one server (plain roles: each sees only its own runs)."""
    auth = await make_auth_server(registry=tree_registry(), roles=("user",), max_run_depth=2,
                                  max_runs_per_tree=3)
    bob = auth.add_key("bob", "user")
    async with key_channel(auth.target, auth.key) as alice_channel, \
            key_channel(auth.target, bob) as bob_channel:
        yield (auth.server, tool_service_pb2_grpc.ToolServiceStub(alice_channel),
               tool_service_pb2_grpc.ToolServiceStub(bob_channel))


async def test_an_agent_hangs_a_call_under_its_own_run(agents: Any) -> None:
    _, alice, _ = agents
    parent = await _start_holding(alice)
    events = [r.event async for r in alice.Execute(_execute("echo", {"text": "hi"}, parent))]
    assert events[-1].result.outcome == events_pb2.OUTCOME_OK
    assert (events[0].parent_run_id, events[0].root_run_id) == (parent, parent)
    listed = await alice.ListRuns(tool_service_pb2.ListRunsRequest(parent_run_id=parent))
    assert [(run.run_id, run.depth) for run in listed.runs] == [(events[0].run_id, 1)]
    # A run hung under it is cancelled with it.
    child = await _start_holding(alice, parent)
    await alice.CancelRun(tool_service_pb2.CancelRunRequest(run_id=parent))
    watched = [r.event async for r in alice.WatchRun(
        tool_service_pb2.WatchRunRequest(run_id=child))]
    assert watched[-1].result.outcome == events_pb2.OUTCOME_CANCELLED


async def test_hostile_parents_are_refused_precisely_and_audited(agents: Any) -> None:
    server, alice, bob = agents
    alices = await _start_holding(alice)
    echo = {"text": "x"}
    # Another principal's run is as unknown as a run that does not exist.
    assert await _refusal(bob, _execute("echo", echo, alices)) == (
        grpc.StatusCode.NOT_FOUND, "RUN_NOT_FOUND")
    assert await _refusal(alice, _execute("echo", echo, "0" * 32)) == (
        grpc.StatusCode.NOT_FOUND, "RUN_NOT_FOUND")
    assert await _refusal(alice, _execute("echo", echo, "not a run id\x00")) == (
        grpc.StatusCode.NOT_FOUND, "RUN_NOT_FOUND")
    assert (await _refusal(alice, _execute("echo", echo, "a" * 65)))[0] \
        is grpc.StatusCode.INVALID_ARGUMENT
    # A finished run takes no more children.
    ran = [r.event async for r in alice.Execute(_execute("echo", echo, ""))]
    finished = ran[-1].run_id
    assert await _refusal(alice, _execute("echo", echo, finished)) == (
        grpc.StatusCode.FAILED_PRECONDITION, "PARENT_RUN_ENDED")
    # max_run_depth is 2: a third level is refused.
    second = await _start_holding(alice, await _start_holding(alice, alices))
    assert await _refusal(alice, _execute("echo", echo, second)) == (
        grpc.StatusCode.FAILED_PRECONDITION, "RUN_DEPTH_EXCEEDED")
    with pytest.raises(grpc.aio.AioRpcError) as caught:  # StartRun the same
        await alice.StartRun(tool_service_pb2.StartRunRequest(
            tool_name="echo", arguments_json=json.dumps(echo), parent_run_id=second))
    assert caught.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    # Every refusal is in the audit, with the parent as named.
    audit = next(i for i in server.interceptors if isinstance(i, AuditInterceptor))
    await eventually(lambda: audit.open_calls == 0, what="every record handed over")
    await audit.writer.flush()
    refused = [r async for r in audit.writer.store.scan()
               if r.method.endswith(("/Execute", "/StartRun")) and r.outcome != "ok"]
    details = [r.detail for r in refused]
    assert len(refused) == 7
    assert sum("RUN_DEPTH_EXCEEDED" in d or "too deep" in d or "levels below" in d
               for d in details) == 2
    assert {r.parent_run_id for r in refused} >= {alices, finished, second}
    assert all(r.root_run_id == alices for r in refused if r.parent_run_id == second)
    # The server still serves, and Alice's run is untouched.
    done = [r.event async for r in alice.Execute(_execute("echo", {"text": "ok"}, alices))]
    assert done[-1].result.output == "ok"
    # That was the tree's third run below its root (max_runs_per_tree is 3): no fourth.
    assert await _refusal(alice, _execute("echo", echo, alices)) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED, "RUN_TREE_FULL")
    listed = await alice.ListRuns(tool_service_pb2.ListRunsRequest(root_run_id=alices))
    assert len(listed.runs) == 4


async def test_a_watcher_of_every_run_may_not_hang_runs_under_another_principals(
        make_auth_server: Any) -> None:
    # Watching is not acting: a child would read and write its tree's state and spend the
    # tree's budget of runs. The watcher sees the run and is refused as for any unknown
    # parent; an admin may hang a run under it.
    auth = await make_auth_server(registry=tree_registry(), roles=("user",))
    watcher, admin = auth.add_key("walt", "watch"), auth.add_key("ada", "admin")
    async with key_channel(auth.target, auth.key) as alice_channel, \
            key_channel(auth.target, watcher) as walt_channel, \
            key_channel(auth.target, admin) as ada_channel:
        alice, walt, ada = (tool_service_pb2_grpc.ToolServiceStub(c)
                            for c in (alice_channel, walt_channel, ada_channel))
        alices = await _start_holding(alice)
        seen = await walt.ListRuns(tool_service_pb2.ListRunsRequest(root_run_id=alices))
        assert [run.run_id for run in seen.runs] == [alices]
        echo = {"text": "x"}
        assert await _refusal(walt, _execute("echo", echo, alices)) == (
            grpc.StatusCode.NOT_FOUND, "RUN_NOT_FOUND")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await walt.StartRun(tool_service_pb2.StartRunRequest(
                tool_name="echo", arguments_json=json.dumps(echo), parent_run_id=alices))
        assert caught.value.code() is grpc.StatusCode.NOT_FOUND
        done = [r.event async for r in ada.Execute(_execute("echo", echo, alices))]
        assert done[-1].result.outcome == events_pb2.OUTCOME_OK
        assert done[0].root_run_id == alices
        listed = await ada.ListRuns(tool_service_pb2.ListRunsRequest(parent_run_id=alices))
        assert [run.run_id for run in listed.runs] == [done[0].run_id]
