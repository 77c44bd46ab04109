"""The approval metrics, scraped from a real server's ``/metrics`` after real calls:
requests by tool, how they ended (approved, denied, timeout, withdrawn), how long they
waited, and the runs waiting now. Counters are process-wide and other tests count too, so
every check is a difference between two scrapes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from stargrpc.v1 import events_pb2, tool_service_pb2
from tests.approval.approval_helpers import (
    approval_registry,
    approve_request,
    execute_request,
    people_of,
    read_until_approval,
    rest_of,
)
from tests.helpers import Samples, eventually, scrape


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def ended(samples: Samples, decision: str) -> tuple[float, float]:
    """How many requests ended so, and how many waits were observed for it."""
    return (value(samples, "stargrpc_approval_decisions_total", decision=decision),
            value(samples, "stargrpc_approval_wait_seconds_count", decision=decision))


@pytest.fixture
async def metrics(auth: Any) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the approval server's metrics endpoint."""
    port = auth.server.http.metrics_port
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
        yield http


@pytest.fixture
async def auth(make_auth_server: Any) -> Any:
    """The approval server of tests/approval/conftest.py, with its metrics served."""
    return await make_auth_server(approval_registry(), approval_timeout_seconds=60,
                                  metrics_port=0)


async def test_requests_decisions_waits_and_pending_runs_are_counted(
        people: Any, metrics: httpx.AsyncClient) -> None:
    before = await scrape(metrics)
    pending = value(before, "stargrpc_approvals_pending")

    approved = people.alice.Execute(execute_request("deploy", {"service": "web"}))
    events, request = await read_until_approval(approved)
    waiting = await scrape(metrics)
    assert value(waiting, "stargrpc_approvals_pending") == pending + 1
    assert value(waiting, "stargrpc_approval_requests_total", tool="deploy") == value(
        before, "stargrpc_approval_requests_total", tool="deploy") + 1
    await people.bob.ApproveRun(approve_request(events[0].run_id, request.approval_id))
    assert (await rest_of(approved))[-1].result.outcome == events_pb2.OUTCOME_OK

    denied = people.alice.Execute(execute_request("deploy", {"service": "db"}))
    events, request = await read_until_approval(denied)
    await people.carol.ApproveRun(approve_request(events[0].run_id, request.approval_id,
                                                  deny=True, reason="not today"))
    assert (await rest_of(denied))[-1].result.outcome == events_pb2.OUTCOME_DENIED

    greeted = await rest_of(people.alice.Execute(execute_request("greet")))
    assert greeted[-1].result.outcome == events_pb2.OUTCOME_OK  # needs no approval

    after = await scrape(metrics)
    assert ended(after, "approved") == tuple(n + 1 for n in ended(before, "approved"))
    assert ended(after, "denied") == tuple(n + 1 for n in ended(before, "denied"))
    assert value(after, "stargrpc_approval_requests_total", tool="deploy") == value(
        before, "stargrpc_approval_requests_total", tool="deploy") + 2
    assert value(after, "stargrpc_approval_requests_total", tool="greet") == value(
        before, "stargrpc_approval_requests_total", tool="greet")
    assert value(after, "stargrpc_approvals_pending") == pending
    # The waits went into the histogram's buckets: the largest holds them all.
    assert value(after, "stargrpc_approval_wait_seconds_bucket", decision="denied",
                 le="+Inf") == ended(after, "denied")[1]

    started = await people.alice.StartRun(tool_service_pb2.StartRunRequest(
        tool_name="deploy", arguments_json='{"service": "queue"}'))
    watch = people.alice.WatchRun(tool_service_pb2.WatchRunRequest(run_id=started.run_id))
    await read_until_approval(watch)
    await people.alice.CancelRun(tool_service_pb2.CancelRunRequest(run_id=started.run_id))
    assert (await rest_of(watch))[-1].result.outcome == events_pb2.OUTCOME_CANCELLED
    withdrawn = tuple(n + 1 for n in ended(after, "withdrawn"))

    async def counted() -> bool:  # the withdrawal is written in the background
        now = await scrape(metrics)
        return (ended(now, "withdrawn") == withdrawn
                and value(now, "stargrpc_approvals_pending") == pending)

    await eventually(counted, what="the withdrawal counted")


async def test_a_request_nobody_decides_is_counted_timeout(make_auth_server: Any,
                                                           tmp_path: Any) -> None:
    auth = await make_auth_server(approval_registry(), approval_timeout_seconds=0.5,
                                  metrics_port=0, keys_file=tmp_path / "timeout-keys.json")
    port = auth.server.http.metrics_port
    async with (httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http,
                people_of(auth) as people):
        before = await scrape(http)
        events = await rest_of(people.alice.Execute(execute_request("deploy",
                                                                    {"service": "web"})))
        assert events[-1].result.error.code == "APPROVAL_TIMEOUT"
        after = await scrape(http)
    assert ended(after, "timeout") == tuple(n + 1 for n in ended(before, "timeout"))
    assert value(after, "stargrpc_approvals_pending") == value(before,
                                                               "stargrpc_approvals_pending")
