"""The Python SDK and call trees: events carry parent_run_id / root_run_id (and
child_run_id on what a child relays), execute hangs a run under a parent, list_runs filters
by tree and by parent."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from stargrpc.client import AsyncClient, CallError, Result, StepStarted
from tests.tree_tools import tree_registry


async def test_the_client_sees_and_builds_call_trees(make_server: Any) -> None:
    server = await make_server(registry=tree_registry())
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    async with AsyncClient(channel, own_channel=True) as client:
        events = [e async for e in client.execute("caller", {"tool": "echo",
                                                             "arguments": {"text": "hi"}})]
        parent = events[0].run_id
        assert (events[0].root_run_id, events[0].parent_run_id) == (parent, "")
        assert isinstance(events[-1], Result) and events[-1].root_run_id == parent
        relayed = [e for e in events if e.child_run_id]
        assert relayed and isinstance(relayed[0], StepStarted)
        child = relayed[0].child_run_id
        assert relayed[0].step.id == f"{child}/s0"

        # A run the caller holds open takes a run hung under it.
        holding = client.execute("tree_node", {"levels": 0, "hold": True})
        first = await anext(holding)
        under = [e async for e in client.execute("echo", {"text": "under"},
                                                 parent_run_id=first.run_id)]
        assert (under[0].parent_run_id, under[0].root_run_id) == (first.run_id, first.run_id)
        children = await client.list_runs(parent_run_id=first.run_id)
        assert [run.run_id for run in children.runs] == [under[0].run_id]
        tree = await client.list_runs(root_run_id=parent)
        assert {run.run_id for run in tree.runs} == {parent, child}
        assert await client.cancel(first.run_id)
        await holding.aclose()
        # A parent that has ended takes no more runs.
        with pytest.raises(CallError) as refused:
            async for _ in client.execute("echo", {"text": "late"}, parent_run_id=parent):
                pass
        assert refused.value.code is grpc.StatusCode.FAILED_PRECONDITION
        assert refused.value.reason == "PARENT_RUN_ENDED"
