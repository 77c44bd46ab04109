"""ListRuns by lane: every run, queued, running or finished, is listed with its lane and
priority, and the ``lane`` filter picks one lane's runs — over gRPC (one server with its
lanes in memory, in Redis, in a Redis Cluster; two replicas of a fleet), ``stargrpc runs
--lane`` and ``GET /v1/runs?lane=``; hostile filters are refused or list nothing."""

from __future__ import annotations

import json
from typing import Any

import grpc
import httpx
import pytest
from google.rpc import error_details_pb2

from stargrpc.v1 import events_pb2, tool_service_pb2
from tests.helpers import eventually, stargrpc_cli, status_details
from tests.lanes.conftest import LaneServer
from tests.lanes.lane_helpers import (
    Holds,
    first_notice,
    hold_request,
    lane_registry,
    lane_settings,
    nap_request,
    started,
    stub_for,
)
from tests.runs_support import as_principal, collect, execute_request

ALICE = as_principal("alice")
BOB = as_principal("bob")
RUNNING, QUEUED, FINISHED = (tool_service_pb2.RUN_STATE_RUNNING,
                             tool_service_pb2.RUN_STATE_QUEUED,
                             tool_service_pb2.RUN_STATE_FINISHED)


def listed(page: tool_service_pb2.ListRunsResponse) -> list[tuple[int, str, int]]:
    return sorted((run.state, run.lane, run.priority) for run in page.runs)


async def running_and_queued(stub: Any, holds: Holds, priority: int, *metadata: Any
                             ) -> tuple[Any, Any]:
    """Execute calls of ``hold``: "a" running in lane slow, then "b" queued behind it."""
    first = stub.Execute(hold_request("a"), metadata=metadata or None)
    await started(holds, 1)
    second = stub.Execute(hold_request("b", priority=priority), metadata=metadata or None)
    await first_notice(second)
    return first, second


async def test_list_runs_filters_by_lane_queued_running_and_finished(
        lanes_at: LaneServer, holds: Holds) -> None:
    _, channel = await lanes_at()
    stub = stub_for(channel)
    napped = await collect(stub.Execute(nap_request(0), metadata=ALICE))
    assert napped[-1].result.outcome == events_pb2.OUTCOME_OK
    quick = await collect(stub.Execute(execute_request("quick"), metadata=ALICE))
    assert quick[-1].result.outcome == events_pb2.OUTCOME_OK
    first, second = await running_and_queued(stub, holds, 2, *ALICE)

    async def lane(name: str, who: Any = ALICE, **fields: Any) -> list[tuple[int, str, int]]:
        return listed(await stub.ListRuns(tool_service_pb2.ListRunsRequest(lane=name, **fields),
                                          metadata=who))

    seen: list[list[tuple[int, str, int]]] = []

    async def slow_listed() -> bool:
        # A fleet lists a run once its first events reach Redis (a moment after admission).
        seen.append(await lane("slow"))
        return seen[-1] == [(RUNNING, "slow", 0), (QUEUED, "slow", 2)]

    await eventually(slow_listed, what=lambda: f"the slow lane's runs: {seen[-1]}")
    assert await lane("slow", state=QUEUED) == [(QUEUED, "slow", 2)]
    assert await lane("timed") == [(FINISHED, "timed", 0)]
    assert await lane("default") == [(FINISHED, "default", 0)]
    assert await lane("slow", BOB) == []  # the filter shows no one else's runs
    assert await lane("nowhere") == []

    holds.release("a", "b")
    for call in (first, second):
        assert (await collect(call))[-1].result.outcome == events_pb2.OUTCOME_OK
    # A finished run keeps its lane and priority (in a fleet: as its replica wrote them).
    assert await lane("slow") == [(FINISHED, "slow", 0), (FINISHED, "slow", 2)]
    everything = listed(await stub.ListRuns(tool_service_pb2.ListRunsRequest(), metadata=ALICE))
    assert {name for _, name, _ in everything} == {"slow", "timed", "default"}


async def test_a_fleet_lists_a_lane_of_runs_on_another_replica(fleet: LaneServer,
                                                               holds: Holds) -> None:
    _, channel_a = await fleet()
    _, channel_b = await fleet()
    a, b = stub_for(channel_a), stub_for(channel_b)
    first, second = await running_and_queued(a, holds, 4, *ALICE)
    seen: list[list[tuple[int, str, int]]] = []

    async def listed_on_b() -> bool:
        seen.append(listed(await b.ListRuns(tool_service_pb2.ListRunsRequest(lane="slow"),
                                            metadata=ALICE)))
        return seen[-1] == [(RUNNING, "slow", 0), (QUEUED, "slow", 4)]

    await eventually(listed_on_b, what=lambda: f"replica b lists: {seen[-1]}")
    holds.release("a", "b")
    for call in (first, second):
        await collect(call)

    async def finished_on_b() -> bool:
        seen.append(listed(await b.ListRuns(tool_service_pb2.ListRunsRequest(lane="slow"),
                                            metadata=ALICE)))
        return seen[-1] == [(FINISHED, "slow", 0), (FINISHED, "slow", 4)]

    await eventually(finished_on_b, what=lambda: f"replica b lists: {seen[-1]}")
    assert not (await b.ListRuns(tool_service_pb2.ListRunsRequest(lane="timed"),
                                 metadata=ALICE)).runs


@pytest.mark.parametrize("name", ["x" * 65, "slow" + "x" * 100_000])
async def test_an_oversized_lane_filter_is_invalid_argument(lane_server: LaneServer,
                                                             name: str) -> None:
    _, channel = await lane_server()
    stub = stub_for(channel)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.ListRuns(tool_service_pb2.ListRunsRequest(lane=name), metadata=ALICE)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    violations = next(d for d in status_details(refused.value)
                      if isinstance(d, error_details_pb2.BadRequest)).field_violations
    assert [v.field for v in violations] == ["lane"]
    assert len(refused.value.details()) < 200  # the value is not echoed back
    assert (await stub.ListRuns(tool_service_pb2.ListRunsRequest(), metadata=ALICE)) is not None


@pytest.mark.parametrize("name", ["slow\x00", "slow\n", "\x1b[31mslow", "sl*", "%", "x" * 64,
                                  "默认"])
async def test_a_lane_filter_no_lane_has_lists_nothing(lane_server: LaneServer, holds: Holds,
                                                       name: str) -> None:
    _, channel = await lane_server()
    stub = stub_for(channel)
    holds.release("a")
    await collect(stub.Execute(hold_request("a"), metadata=ALICE))
    page = await stub.ListRuns(tool_service_pb2.ListRunsRequest(lane=name), metadata=ALICE)
    assert not page.runs and not page.next_page_token
    slow = await stub.ListRuns(tool_service_pb2.ListRunsRequest(lane="slow"), metadata=ALICE)
    assert listed(slow) == [(FINISHED, "slow", 0)]


async def test_the_cli_and_the_http_api_filter_runs_by_lane(make_server: Any,
                                                            holds: Holds) -> None:
    server = await make_server(registry=lane_registry(), http_port=0, **lane_settings())
    target = f"127.0.0.1:{server.port}"
    async with grpc.aio.insecure_channel(target) as channel:
        stub = stub_for(channel)
        napped = await collect(stub.Execute(nap_request(0)))
        first, second = await running_and_queued(stub, holds, 2)
        nap_id = napped[0].run_id

        code, out, err = await stargrpc_cli("runs", "--target", target, "--lane", "slow",
                                         "--json")
        assert code == 0, err
        runs = json.loads(out)["runs"]
        assert sorted((r["state"], r["lane"]) for r in runs) == [
            ("RUN_STATE_QUEUED", "slow"), ("RUN_STATE_RUNNING", "slow")]
        code, out, err = await stargrpc_cli("runs", "--target", target, "--lane", "slow")
        assert code == 0, err
        assert len(out.splitlines()) == 2 and "lane slow, #1 in line" in out
        assert nap_id not in out
        code, out, err = await stargrpc_cli("runs", "--target", target, "--lane", "timed")
        assert code == 0 and nap_id in out
        code, out, err = await stargrpc_cli("runs", "--target", target, "--lane", "nowhere")
        assert code == 0 and not out and "no runs" in err
        code, _, err = await stargrpc_cli("runs", "--target", target, "--lane", "x" * 65)
        assert code != 0 and "lane" in err and "x" * 65 not in err

        base_url = f"http://127.0.0.1:{server.http.gateway_port}"
        async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
            reply = await http.get("/v1/runs", params={"lane": "slow", "state": "queued"})
            assert reply.status_code == 200, reply.text
            assert [(r["lane"], r["priority"]) for r in reply.json()["runs"]] == [("slow", 2)]
            timed = (await http.get("/v1/runs", params={"lane": "timed"})).json()["runs"]
            assert [r["run_id"] for r in timed] == [nap_id]
            unknown = await http.get("/v1/runs", params={"lane": "slow\x00\u202e"})
            assert unknown.status_code == 200 and unknown.json().get("runs", []) == []
            oversized = await http.get("/v1/runs", params={"lane": "x" * 5000})
            assert oversized.status_code == 400 and "lane" in oversized.text
            assert "x" * 100 not in oversized.text
            assert (await http.get("/v1/runs")).status_code == 200  # still serving
        holds.release("a", "b")
        for call in (first, second):
            await collect(call)
