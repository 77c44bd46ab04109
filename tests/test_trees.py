"""Call trees on a real server (memory store): a tool calls a tool (``ctx.call``, async and
sync), the child's steps nested in the parent's stream, parent and root in events, ListRuns
and the audit; failed and refused children; the caps (depth, tree size) ending a recursion
bomb with every child audited; a tree of depth 3 with fan-out cancelled from its root."""

from __future__ import annotations

import json
import uuid
from typing import Any

import grpc
import pytest

from stargrpc.audit.record import AuditRecord
from stargrpc.server.grpc_server import StargrpcServer
from stargrpc.server.interceptors.audit import AuditInterceptor
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.helpers import eventually, key_channel, run_tool, status_details
from tests.tree_tools import tree_registry


async def _records(server: StargrpcServer) -> list[AuditRecord]:
    audit = next(i for i in server.interceptors if isinstance(i, AuditInterceptor))
    await eventually(lambda: audit.open_calls == 0, what="every open call's record written")
    await audit.writer.flush()
    return [r async for r in audit.writer.store.scan()]


async def _tree(stub: Any, root: str) -> list[tool_service_pb2.RunSummary]:
    reply = await stub.ListRuns(tool_service_pb2.ListRunsRequest(root_run_id=root,
                                                                 page_size=200))
    return list(reply.runs)


@pytest.fixture
async def tree_server(make_server: Any) -> Any:
    server = await make_server(registry=tree_registry(), inline_file_bytes=1024)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield server, tool_service_pb2_grpc.ToolServiceStub(channel)


async def _still_serving(stub: Any) -> None:
    events = await run_tool(stub, "echo", {"text": "still here"})
    assert events[-1].result.output == "still here"


@pytest.mark.parametrize("tool", ["caller", "caller_sync"])
async def test_a_tool_calls_a_tool_and_the_child_nests_in_the_parent_stream(
        tree_server: Any, tool: str) -> None:
    server, stub = tree_server
    events = await run_tool(stub, tool, {"tool": "count", "arguments": {"to": 2}})
    result = events[-1].result
    assert result.outcome == events_pb2.OUTCOME_OK, result
    reported = json.loads(result.output)
    child_id = reported["child_run_id"]
    assert reported["outcome"] == "OK"
    parent_id = events[0].run_id
    # The run's first event and its Result say where it sits: the top of its own tree.
    assert events[0].root_run_id == parent_id and not events[0].parent_run_id
    assert events[-1].root_run_id == parent_id
    assert result.usage.child_runs == 1
    # The child's steps and deltas came through the parent's stream, marked with its id,
    # its ids prefixed, its top-level step nested under the parent's "Calling" step.
    calling = next(e.step.step.id for e in events
                   if e.HasField("step") and e.step.step.title == "Calling")
    relayed = [e for e in events if e.child_run_id]
    assert relayed and all(e.child_run_id == child_id for e in relayed)
    starts = [e.step.step for e in relayed if e.step.phase == events_pb2.STEP_PHASE_START]
    assert starts[0].id == f"{child_id}/s0" and starts[0].parent_id == calling
    assert starts[1].parent_id == f"{child_id}/s0"
    deltas = [e.step.delta for e in relayed if e.step.phase == events_pb2.STEP_PHASE_DELTA]
    assert deltas == ["1\n", "2\n"]
    # The relayed events come before the parent's calling step ends.
    ended = next(i for i, e in enumerate(events) if e.HasField("step")
                 and e.step.phase == events_pb2.STEP_PHASE_END and e.step.step.id == calling)
    assert all(events.index(e) < ended for e in relayed)
    # The child's own log says it is the parent's.
    child_events = [r.event async for r in stub.WatchRun(
        tool_service_pb2.WatchRunRequest(run_id=child_id))]
    assert child_events[0].parent_run_id == parent_id
    assert child_events[0].root_run_id == parent_id
    assert child_events[-1].parent_run_id == parent_id
    # ListRuns lists the tree, and the children of a run.
    tree = {run.run_id: run for run in await _tree(stub, parent_id)}
    assert set(tree) == {parent_id, child_id}
    assert (tree[child_id].parent_run_id, tree[child_id].root_run_id,
            tree[child_id].depth) == (parent_id, parent_id, 1)
    assert (tree[parent_id].parent_run_id, tree[parent_id].root_run_id,
            tree[parent_id].depth) == ("", parent_id, 0)
    children = await stub.ListRuns(tool_service_pb2.ListRunsRequest(parent_run_id=parent_id))
    assert [run.run_id for run in children.runs] == [child_id]
    # One audit record each, the child's under its parent and root.
    records = {r.run_id: r for r in await _records(server)
               if r.method.endswith(("/Execute", "/Call"))}
    assert records[child_id].method.endswith("/Call")
    assert records[child_id].tool == "count" and records[child_id].outcome == "ok"
    assert (records[child_id].parent_run_id, records[child_id].root_run_id) == (
        parent_id, parent_id)
    assert records[child_id].principal == records[parent_id].principal
    assert (records[parent_id].parent_run_id, records[parent_id].root_run_id) == (
        "", parent_id)


async def test_a_failed_child_is_the_parent_tools_to_handle(tree_server: Any) -> None:
    server, stub = tree_server
    caught = await run_tool(stub, "caller", {"tool": "flop", "catch": True,
                                             "arguments": {"message": "broken"}})
    reported = json.loads(caught[-1].result.output)
    assert caught[-1].result.outcome == events_pb2.OUTCOME_OK
    assert reported["failed"] == "FAILED" and reported["code"] == "TOOL_FAILED"
    assert not reported["refused"] and reported["child_run_id"]
    # Left uncaught, the child's outcome and code end the parent.
    uncaught = await run_tool(stub, "caller", {"tool": "flop", "arguments": {}})
    assert uncaught[-1].result.outcome == events_pb2.OUTCOME_FAILED
    assert uncaught[-1].result.error.code == "TOOL_FAILED"
    assert "flop" in uncaught[-1].result.error.message
    records = [r for r in await _records(server) if r.tool == "flop"]
    assert [r.outcome for r in records] == ["failed", "failed"]


async def test_the_files_of_a_child_come_back_whole_even_when_streamed(tree_server: Any) -> None:
    _, stub = tree_server
    events = await run_tool(stub, "caller", {"tool": "flop",
                                             "arguments": {"message": "", "file_bytes": 5000}})
    reported = json.loads(events[-1].result.output)
    assert reported["files"] == [["out.txt", "x" * 5000]]  # over inline_file_bytes (1024)
    # The child's chunks stay in the child's log: the parent relays steps only.
    assert not any(e.HasField("file_chunk") for e in events)


@pytest.mark.parametrize(("arguments", "status", "reason"), [
    ({"tool": "no_such_tool"}, "NOT_FOUND", "TOOL_NOT_FOUND"),
    ({"tool": "count", "arguments": {"to": "many"}}, "INVALID_ARGUMENT", "INVALID_ARGUMENT"),
])
async def test_a_refused_child_raises_its_status_and_is_audited(
        tree_server: Any, arguments: dict[str, Any], status: str, reason: str) -> None:
    server, stub = tree_server
    events = await run_tool(stub, "caller", {**arguments, "catch": True})
    reported = json.loads(events[-1].result.output)
    assert reported == {"failed": "FAILED", "code": reason, "refused": True, "status": status,
                        "child_run_id": ""}
    root = events[0].run_id
    refused = [r for r in await _records(server) if r.root_run_id == root and not r.run_id]
    assert len(refused) == 1 and refused[0].outcome == "invalid"
    assert refused[0].detail.startswith(reason) and refused[0].parent_run_id == root
    assert refused[0].tool == arguments["tool"]
    await _still_serving(stub)


async def _bomb(make_server: Any, fan_out: int, **caps: Any) -> tuple[
        events_pb2.Result, list[tool_service_pb2.RunSummary], list[AuditRecord]]:
    """Sets off a recursion bomb on a server with ``caps``: its Result, the runs of its tree
    and the audit records of the tree; checks that every run started is audited and that
    the server still serves."""
    server = await make_server(registry=tree_registry(), **caps)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        events = await run_tool(stub, "bomb", {"fan_out": fan_out})
        tree = await _tree(stub, events[0].run_id)
        records = [r for r in await _records(server) if r.root_run_id == events[0].run_id]
        assert {r.run_id for r in records if r.run_id} == {run.run_id for run in tree}
        await _still_serving(stub)
    return events[-1].result, tree, [r for r in records if not r.run_id]


async def test_a_recursion_bomb_ends_at_the_depth_cap_with_every_child_audited(
        make_server: Any) -> None:
    result, tree, refused = await _bomb(make_server, 1, max_run_depth=3)
    assert result.outcome == events_pb2.OUTCOME_FAILED
    assert result.error.code == "RUN_DEPTH_EXCEEDED"
    assert sorted(run.depth for run in tree) == [0, 1, 2, 3]
    assert all(run.outcome == events_pb2.OUTCOME_FAILED for run in tree)
    assert len(refused) == 1 and refused[0].detail.startswith("RUN_DEPTH_EXCEEDED")
    assert refused[0].outcome == "invalid"  # FAILED_PRECONDITION


async def test_a_fanning_bomb_ends_at_the_tree_size_cap_with_every_child_audited(
        make_server: Any) -> None:
    result, tree, refused = await _bomb(make_server, 2, max_runs_per_tree=6)
    assert result.outcome == events_pb2.OUTCOME_FAILED
    assert result.error.code in ("RUN_TREE_FULL", "RUN_DEPTH_EXCEEDED")
    assert len(tree) == 1 + 6  # the root and the six runs the tree may start
    assert refused and all(r.detail.startswith("RUN_TREE_FULL") for r in refused)
    assert all(r.outcome == "failed" for r in refused)  # RESOURCE_EXHAUSTED


async def test_cancelling_the_root_cancels_a_tree_of_depth_3_with_fan_out(
        tree_server: Any) -> None:
    _, stub = tree_server
    started = await stub.StartRun(tool_service_pb2.StartRunRequest(
        tool_name="tree_node", arguments_json=json.dumps({"levels": 3, "fan_out": 2,
                                                          "hold": True})))
    root = started.run_id
    # 1 + 2 + 4 + 8 runs, every leaf holding.
    await eventually(lambda: _count(stub, root, 15), what="the whole tree running")
    tree = await _tree(stub, root)
    assert sorted(run.depth for run in tree) == [0] + [1] * 2 + [2] * 4 + [3] * 8
    reply = await stub.CancelRun(tool_service_pb2.CancelRunRequest(run_id=root))
    assert reply.cancelled

    async def all_ended() -> bool:
        return all(run.state == tool_service_pb2.RUN_STATE_FINISHED
                   for run in await _tree(stub, root))

    await eventually(all_ended, what="every run of the tree ended")
    tree = await _tree(stub, root)
    assert len(tree) == 15
    assert {run.outcome for run in tree} == {events_pb2.OUTCOME_CANCELLED}
    await _still_serving(stub)


async def _count(stub: Any, root: str, wanted: int) -> bool:
    runs = await _tree(stub, root)
    return len(runs) == wanted and all(run.current_step for run in runs)


async def test_list_runs_refuses_an_oversized_tree_filter(tree_server: Any) -> None:
    _, stub = tree_server
    for name in ("root_run_id", "parent_run_id"):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.ListRuns(tool_service_pb2.ListRunsRequest(**{name: "x" * 65}))
        assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert name in str(status_details(caught.value))
    await _still_serving(stub)


async def test_a_parent_that_ends_first_cancels_the_children_still_running(
        tree_server: Any) -> None:
    _, stub = tree_server
    events = await run_tool(stub, "orphaner", {"started": uuid.uuid4().hex})
    assert events[-1].result.outcome == events_pb2.OUTCOME_OK
    parent = events[0].run_id
    children = await stub.ListRuns(tool_service_pb2.ListRunsRequest(parent_run_id=parent))
    assert len(children.runs) == 1
    watched = [r.event async for r in stub.WatchRun(
        tool_service_pb2.WatchRunRequest(run_id=children.runs[0].run_id))]
    assert watched[-1].result.outcome == events_pb2.OUTCOME_CANCELLED
    assert watched[-1].result.error.code == "PARENT_RUN_ENDED"


async def test_the_tree_time_budget_refuses_late_children_and_bounds_running_ones(
        make_server: Any) -> None:
    server = await make_server(registry=tree_registry(), max_tree_seconds=0.5)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        late = await run_tool(stub, "caller", {"tool": "echo", "arguments": {"text": "x"},
                                               "delay": 0.6, "catch": True})
        assert json.loads(late[-1].result.output)["code"] == "RUN_TREE_EXPIRED"
        # A child still running when the tree's time is up is stopped.
        held = await run_tool(stub, "caller", {"tool": "tree_node", "catch": True,
                                               "arguments": {"levels": 0, "hold": True}})
        assert json.loads(held[-1].result.output)["failed"] == "TIMEOUT"
        # Uncaught, the child's TIMEOUT ends its parent so (an outcome tools cannot raise).
        uncaught = await run_tool(stub, "caller", {"tool": "tree_node",
                                                   "arguments": {"levels": 0, "hold": True}})
        assert uncaught[-1].result.outcome == events_pb2.OUTCOME_TIMEOUT
        assert uncaught[-1].result.error.code == "CLIENT_DEADLINE"
        await _still_serving(stub)


async def test_a_child_runs_with_the_callers_permissions(make_auth_server: Any) -> None:
    auth = await make_auth_server(registry=tree_registry(), roles=("user",),
                                  tool_permissions={"flop": {"roles": ["ops"]}})
    async with key_channel(auth.target, auth.key) as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        events = await run_tool(stub, "caller", {"tool": "flop", "catch": True})
        reported = json.loads(events[-1].result.output)
        assert reported["failed"] == "DENIED" and reported["status"] == "PERMISSION_DENIED"
        uncaught = await run_tool(stub, "caller", {"tool": "flop"})
        assert uncaught[-1].result.outcome == events_pb2.OUTCOME_DENIED
        records = [r for r in await _records(auth.server) if r.tool == "flop"]
        assert [r.outcome for r in records] == ["denied", "denied"]
        assert all(r.principal == "tester" for r in records)


async def test_a_tree_shares_its_state_between_parent_and_child(tree_server: Any) -> None:
    _, stub = tree_server
    events = await run_tool(stub, "caller", {"tool": "state_tree_probe", "times": 2})
    (first, first_saw), (second, second_saw) = json.loads(events[-1].result.output)["all"]
    assert first != second
    assert first_saw == second_saw == first  # the second sibling read what the first wrote
    again = await run_tool(stub, "caller", {"tool": "state_tree_probe"})
    (third, third_saw), = json.loads(again[-1].result.output)["all"]
    assert third_saw == third  # another tree: a scope of its own


async def test_cancelling_a_sync_tool_blocked_in_call_sync_cancels_its_child(
        tree_server: Any) -> None:
    _, stub = tree_server
    started = await stub.StartRun(tool_service_pb2.StartRunRequest(
        tool_name="caller_sync", arguments_json=json.dumps(
            {"tool": "tree_node", "arguments": {"levels": 0, "hold": True}})))
    root = started.run_id
    await eventually(lambda: _count(stub, root, 2), what="the caller and its held child")
    assert (await stub.CancelRun(tool_service_pb2.CancelRunRequest(run_id=root))).cancelled

    async def both_ended() -> bool:
        return all(run.state == tool_service_pb2.RUN_STATE_FINISHED
                   for run in await _tree(stub, root))

    await eventually(both_ended, what="the caller and its child ended")
    assert {run.outcome for run in await _tree(stub, root)} == {events_pb2.OUTCOME_CANCELLED}
    await _still_serving(stub)
