"""The Prometheus endpoint (``serve --metrics-port``): scraped over HTTP from a real server
after real calls. Counters are process-wide and other tests count too, so every check is a
difference between two scrapes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import httpx
import pytest
from pydantic import BaseModel

from stargrpc import ToolContext, tool
from stargrpc.registry import Registry, load_registry, spec_of
from stargrpc.server.grpc_server import StargrpcServer
from stargrpc.v1 import tool_service_pb2, tool_service_pb2_grpc
from tests.helpers import Samples, phases, run_tool, scrape

RELEASE = asyncio.Event()


class NoArgs(BaseModel):
    pass


@tool()
async def broken(ctx: ToolContext, args: NoArgs) -> str:
    """Always raises."""
    raise RuntimeError("broken on purpose")


@tool(soft_timeout=1.0)
async def stuck(ctx: ToolContext, args: NoArgs) -> str:
    """Never makes progress; the critic stops it."""
    await asyncio.Event().wait()
    return "unreachable"


@tool()
async def held(ctx: ToolContext, args: NoArgs) -> str:
    """Waits until the test releases it."""
    await ctx.delta("holding\n")
    await RELEASE.wait()
    return "released"


def registry() -> Registry:
    bundled = load_registry(bundled=True, entry_points=False)
    extra = [spec_of(fn) for fn in (broken, stuck, held)]
    return Registry([*bundled.values(), *(s for s in extra if s is not None)])


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def total(samples: Samples, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


@pytest.fixture
async def metrics_server(make_server) -> AsyncIterator[tuple[StargrpcServer, httpx.AsyncClient]]:
    server = await make_server(registry=registry(), metrics_port=0)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.http.metrics_port}",
                                 timeout=30) as http:
        yield server, http


async def test_metrics_count_runs_by_tool_and_outcome(metrics_server) -> None:
    server, http = metrics_server
    before = await scrape(http)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        streamed = 0
        for text in ("a", "b"):
            streamed += len(await run_tool(stub, "echo", {"text": text}))
        broken_events = await run_tool(stub, "broken", {})
        stuck_events = await run_tool(stub, "stuck", {})
        streamed += len(broken_events) + len(stuck_events)
    after = await scrape(http)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert phases(broken_events)[-1] == "RESULT ERROR"
    assert phases(stuck_events)[-1] == "RESULT TIMEOUT"
    assert delta("tool_executor_tasks_total", tool="echo", outcome="ok") == 2
    assert delta("tool_executor_tasks_total", tool="broken", outcome="error") == 1
    assert delta("tool_executor_tasks_total", tool="stuck", outcome="timeout") == 1
    assert delta("tool_executor_duration_seconds_count", tool="echo") == 2
    assert delta("tool_executor_duration_seconds_sum", tool="echo") >= 0
    assert delta("tool_executor_events_streamed_total", rpc="Execute") == streamed
    assert delta("tool_executor_critic_kills_total", reason="no_progress") == 1
    # The half-time warning is counted once per notice the client saw (a loop stalled past
    # the whole soft timeout would stop the run without one).
    notices = [e for e in stuck_events if e.HasField("notice")]
    assert delta("tool_executor_critic_warnings_total") == len(notices)
    assert delta("tool_executor_critic_extensions_total") >= 1  # the runs' starts
    assert ("tool_executor_audit_queue_depth", ()) in after


async def test_runs_in_flight_rises_and_falls(metrics_server) -> None:
    server, http = metrics_server
    RELEASE.clear()
    before = value(await scrape(http), "tool_executor_runs_in_flight")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        call = stub.Execute(tool_service_pb2.ExecuteRequest(tool_name="held"))
        await call.read()  # the run has started
        during = value(await scrape(http), "tool_executor_runs_in_flight")
        RELEASE.set()
        while await call.read() is not grpc.aio.EOF:
            pass
    after = value(await scrape(http), "tool_executor_runs_in_flight")

    assert during == before + 1
    assert after == before


async def test_auth_failures_are_counted(make_server, tmp_path) -> None:
    server = await make_server(metrics_port=0, insecure_no_auth=False,
                               keys_file=tmp_path / "keys.json")
    async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{server.http.metrics_port}", timeout=30) as http:
        before = await scrape(http)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = tool_service_pb2_grpc.ToolServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.ListTools(tool_service_pb2.ListToolsRequest(),
                                     metadata=(("authorization", "Bearer not-a-key"),))
        after = await scrape(http)

    assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert (total(after, "tool_executor_auth_failures_total")
            - total(before, "tool_executor_auth_failures_total")) == 1


async def test_endpoint_speaks_openmetrics_and_serves_nothing_else(metrics_server) -> None:
    _, http = metrics_server

    open_metrics = await http.get("/metrics",
                                  headers={"Accept": "application/openmetrics-text"})
    elsewhere = await http.get("/")

    assert open_metrics.headers["content-type"].startswith("application/openmetrics-text")
    assert open_metrics.text.rstrip().endswith("# EOF")
    assert "tool_executor_tasks_total" in open_metrics.text
    assert elsewhere.status_code == 404
