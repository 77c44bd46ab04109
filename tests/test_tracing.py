"""OpenTelemetry traces of a real server, exported to memory: the call's span continues the
caller's trace (W3C ``traceparent`` metadata), the run's span is its child, and every step
the tool opens is a child span of its parent step."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import grpc
import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from pydantic import BaseModel

from stargrpc import ToolContext, tool
from stargrpc.registry import Registry, load_registry, spec_of
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.helpers import eventually, phases

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"

_EXPORTER = InMemorySpanExporter()


class NoArgs(BaseModel):
    pass


@tool()
async def nested(ctx: ToolContext, args: NoArgs) -> str:
    """Two levels of steps, the inner one failing and handled."""
    async with ctx.step("Outer") as outer:
        await outer.delta("a")
        try:
            async with ctx.step("Inner"):
                raise ValueError("inner broke")
        except ValueError:
            pass
    async with ctx.step("Second"):
        pass
    return "done"


@tool()
async def instrumented(ctx: ToolContext, args: NoArgs) -> str:
    """Makes a span of its own, as an instrumented library would."""
    with trace.get_tracer("some.library").start_as_current_span("library call"):
        pass
    return "ok"


@tool()
async def crashes(ctx: ToolContext, args: NoArgs) -> str:
    """Raises inside a step."""
    async with ctx.step("Doomed"):
        raise RuntimeError("no")


@pytest.fixture(scope="module", autouse=True)
def in_memory_spans() -> None:
    """One SDK provider per process (OpenTelemetry allows setting it once), exporting here."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    _EXPORTER.clear()
    yield _EXPORTER
    _EXPORTER.clear()


def registry() -> Registry:
    bundled = load_registry(bundled=True, entry_points=False)
    extra = [spec_of(nested), spec_of(crashes), spec_of(instrumented)]
    return Registry([*bundled.values(), *(s for s in extra if s is not None)])


@pytest.fixture
async def stub(make_server) -> AsyncIterator[tool_service_pb2_grpc.ToolServiceStub]:
    server = await make_server(registry=registry(), tracing=True, tracing_exporter="none")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    yield tool_service_pb2_grpc.ToolServiceStub(channel)
    await channel.close()


async def run_tool(stub: tool_service_pb2_grpc.ToolServiceStub, tool_name: str,
                   metadata: tuple[tuple[str, str], ...] = ()) -> list[events_pb2.RunEvent]:
    request = tool_service_pb2.ExecuteRequest(tool_name=tool_name)
    return [r.event async for r in stub.Execute(request, metadata=metadata)]


def by_name(finished: tuple[ReadableSpan, ...]) -> dict[str, ReadableSpan]:
    named = {span.name: span for span in finished}
    assert len(named) == len(finished), [s.name for s in finished]
    return named


def parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


async def test_run_span_continues_the_callers_trace_with_a_span_per_step(stub, spans) -> None:
    events = await run_tool(stub, "nested", metadata=(("traceparent", TRACEPARENT),))

    assert phases(events)[-1] == "RESULT OK"
    named = by_name(spans.get_finished_spans())
    call = named["stargrpc.v1.ToolService/Execute"]
    run = named["run nested"]
    outer, inner, second = named["Outer"], named["Inner"], named["Second"]
    assert {span.context.trace_id for span in named.values()} == {int(TRACE_ID, 16)}
    assert call.kind is SpanKind.SERVER
    assert parent_of(call) == int(PARENT_SPAN_ID, 16)
    assert call.attributes["rpc.method"] == "Execute"
    assert parent_of(run) == call.context.span_id
    assert parent_of(outer) == parent_of(second) == run.context.span_id
    assert parent_of(inner) == outer.context.span_id
    assert run.attributes["stargrpc.run_id"] == events[0].run_id
    assert run.attributes["stargrpc.tool"] == "nested"
    assert run.attributes["stargrpc.outcome"] == "ok"
    assert run.status.status_code is StatusCode.UNSET
    assert inner.status.status_code is StatusCode.ERROR
    assert outer.status.status_code is StatusCode.UNSET
    assert outer.attributes["stargrpc.step.deltas"] == 1
    # Steps happen in order, inside the run, inside the call.
    assert call.start_time <= run.start_time <= outer.start_time <= inner.start_time
    assert inner.end_time <= outer.end_time <= second.start_time <= run.end_time
    assert run.end_time <= call.end_time


async def test_a_failed_run_is_an_error_span(stub, spans) -> None:
    events = await run_tool(stub, "crashes")

    assert phases(events)[-1] == "RESULT ERROR"
    named = by_name(spans.get_finished_spans())
    run = named["run crashes"]
    assert run.status.status_code is StatusCode.ERROR
    assert run.attributes["stargrpc.error_code"] == "TOOL_EXCEPTION"
    assert named["Doomed"].status.status_code is StatusCode.ERROR
    # No caller trace: the call starts a new one, and the run still belongs to it.
    assert named["stargrpc.v1.ToolService/Execute"].parent is None
    assert run.context.trace_id == named["stargrpc.v1.ToolService/Execute"].context.trace_id


async def test_spans_a_tool_makes_nest_under_its_run(stub, spans) -> None:
    await run_tool(stub, "instrumented")

    named = by_name(spans.get_finished_spans())
    assert parent_of(named["library call"]) == named["run instrumented"].context.span_id


async def test_refused_calls_are_traced_without_a_run(stub, spans) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await run_tool(stub, "no-such-tool", metadata=(("traceparent", TRACEPARENT),))

    assert refused.value.code() is grpc.StatusCode.NOT_FOUND
    # The refusal's status can reach the caller before the server's interceptor has ended
    # the call's span (after its handler raised): wait for it, bounded.
    (call,) = await eventually(spans.get_finished_spans, within=10, interval=0.01,
                               what="the refused call's span ended")
    assert call.name == "stargrpc.v1.ToolService/Execute"
    assert call.attributes["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]
    # A refusal is the caller's problem, not a server fault.
    assert call.status.status_code is StatusCode.UNSET
    assert call.context.trace_id == int(TRACE_ID, 16)


async def test_list_tools_is_traced(stub, spans) -> None:
    await stub.ListTools(tool_service_pb2.ListToolsRequest(),
                         metadata=(("traceparent", TRACEPARENT),))

    # The reply can reach the caller before the server's interceptor ends the span.
    (call,) = await eventually(spans.get_finished_spans, within=10, interval=0.01,
                               what="the ListTools span ended")
    assert call.name == "stargrpc.v1.ToolService/ListTools"
    assert parent_of(call) == int(PARENT_SPAN_ID, 16)


async def test_the_gateway_forwards_the_trace_context(make_server, spans) -> None:
    server = await make_server(registry=registry(), tracing=True, tracing_exporter="none",
                               http_port=0)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.http.gateway_port}",
                                 timeout=30) as http:
        reply = await http.post("/v1/tools/echo:execute?wait=true",
                                json={"arguments": {"text": "traced"}},
                                headers={"traceparent": TRACEPARENT})

    assert reply.status_code == 200
    named = by_name(spans.get_finished_spans())
    assert parent_of(named["stargrpc.v1.ToolService/Execute"]) == int(PARENT_SPAN_ID, 16)
    assert named["run echo"].context.trace_id == int(TRACE_ID, 16)


async def test_the_mcp_endpoint_forwards_the_trace_context(make_server, spans) -> None:
    server = await make_server(registry=registry(), tracing=True, tracing_exporter="none",
                               mcp_port=0)
    async with httpx2.AsyncClient(headers={"traceparent": TRACEPARENT}, timeout=30) as http, \
            Client(streamable_http_client(f"http://127.0.0.1:{server.mcp.port}/mcp",
                                          http_client=http), mode="legacy") as client:
        answer = await client.call_tool("echo", {"text": "traced"})

    assert not answer.is_error
    executes = [span for span in spans.get_finished_spans()
                if span.name == "stargrpc.v1.ToolService/Execute"]
    # The call's span is the gRPC server's, parented by the MCP request's trace context
    # (not by whatever span the MCP SDK had open in the bridge's task).
    assert [parent_of(span) for span in executes] == [int(PARENT_SPAN_ID, 16)]
    assert executes[0].kind is SpanKind.SERVER
    runs = [span for span in spans.get_finished_spans() if span.name == "run echo"]
    assert [span.context.trace_id for span in runs] == [int(TRACE_ID, 16)]
