"""In-process calls (stargrpc.server.inprocess) answer as a real channel to the same server
does: the same responses, the same statuses (code, details, rich details), the same
interceptors and audit, cancellation and deadlines reaching the handler."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from stargrpc.client.errors import CallError
from stargrpc.errors import RequestError
from stargrpc.gateway.client import GatewayClient
from stargrpc.server.grpc_server import StargrpcServer
from stargrpc.server.inprocess import InProcessChannel, InProcessServer
from stargrpc.server.interceptors import build_chain
from stargrpc.settings import Settings
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.conftest import AuthServerFactory, ServerFactory
from tests.helpers import records_of
from tests.mcp.mcp_tools import CANCELLED, GATES, mcp_registry
from tests.runs_support import collect, execute_request, key

# -- the same handlers behind a grpc.aio server and an InProcessServer ------------------------

#: Set by the caller of a call; must never be seen by the handler.
CALLER_VARIABLE: contextvars.ContextVar[str] = contextvars.ContextVar("caller", default="")

#: What each streaming call's handler saw when it ended, by request.
ENDED: dict[bytes, dict[str, Any]] = {}

#: Set by a streaming call's done callback, by request, and by the hanging unary handler
#: ("hang", "hang-cancelled"), when a test is waiting for it.
DONE: dict[bytes | str, asyncio.Event] = {}


def _done(request: bytes, seen: dict[str, Any]) -> None:
    seen["done_callback"] = True
    if request in DONE:
        DONE[request].set()


async def _unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    if request == b"raise":
        raise ValueError("boom")
    if request == b"abort":
        await context.abort(grpc.StatusCode.NOT_FOUND, "no such thing",
                            (("x-reason", "gone"), ("x-blob-bin", b"\x00\x01")))
    if request == b"abort-with-status":
        await context.abort_with_status(RequestError("bad", reason="WHY").to_status())
    if request == b"initial-metadata":
        await context.send_initial_metadata((("x-first", "1"),))
        return b"after the initial metadata"
    if request == b"set-code":
        context.set_code(grpc.StatusCode.ALREADY_EXISTS)
        context.set_details("there already")
        context.set_trailing_metadata((("x-where", "here"),))
        return b"dropped"
    if request == b"set-code-then-raise":
        context.set_code(grpc.StatusCode.FAILED_PRECONDITION)
        raise KeyError("k")
    if request == b"big":
        return b"b" * 3000
    if request == b"context":
        metadata = dict(context.invocation_metadata() or ())
        return json.dumps({"caller_variable": CALLER_VARIABLE.get(),
                           "k": metadata.get("k"),
                           "remaining": context.time_remaining() is not None}).encode()
    if request == b"hang":
        if "hang" in DONE:  # a test waits for the handler to start, then to be cancelled
            DONE["hang"].set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            if "hang-cancelled" in DONE:
                DONE["hang-cancelled"].set()
            raise
    return b"echo:" + request


async def _stream(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    seen: dict[str, Any] = {}
    context.add_done_callback(lambda ctx: _done(request, seen))
    try:
        for index in range(3):
            yield b"%d" % index
        if request == b"then-abort":
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, "past the end")
        if request in (b"then-hang", b"then-deadline"):
            await asyncio.Event().wait()
    except asyncio.CancelledError:
        seen["cancelled"] = True
        seen["time_remaining"] = context.time_remaining()
        raise
    finally:
        ENDED[request] = seen


async def _written(request: bytes, context: grpc.aio.ServicerContext) -> None:
    for index in range(2):
        await context.write(b"w%d" % index)


def _sync_unary(request: bytes, context: grpc.ServicerContext) -> bytes:
    return b"sync:" + request


def _handlers() -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler("test.S", {
        "Unary": grpc.unary_unary_rpc_method_handler(_unary),
        "Stream": grpc.unary_stream_rpc_method_handler(_stream),
        "Written": grpc.unary_stream_rpc_method_handler(_written),
        "Sync": grpc.unary_unary_rpc_method_handler(_sync_unary),
    })


class _Counting(grpc.aio.ServerInterceptor):
    """Counts the calls it sees, by method."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def intercept_service(self, continuation: Callable[..., Any],
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        self.seen.append(handler_call_details.method)
        return await continuation(handler_call_details)


@pytest.fixture
async def both() -> AsyncIterator[tuple[grpc.aio.Channel, InProcessChannel,
                                        _Counting, _Counting]]:
    """A grpc.aio server and an InProcessServer with the same handlers, limits and (each
    its own) counting interceptor; a channel to each."""
    limits = {"max_receive_message_bytes": 1024, "max_send_message_bytes": 2048}
    real_interceptor, local_interceptor = _Counting(), _Counting()
    server = grpc.aio.server(interceptors=[real_interceptor], options=[
        ("grpc.max_receive_message_length", limits["max_receive_message_bytes"]),
        ("grpc.max_send_message_length", limits["max_send_message_bytes"])])
    inprocess = InProcessServer([local_interceptor], **limits)
    inprocess.registrar(server).add_generic_rpc_handlers((_handlers(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel, inprocess.channel("test"), real_interceptor, local_interceptor
    finally:
        await inprocess.stop()
        await server.stop(0)


def _status(error: grpc.aio.AioRpcError) -> tuple[Any, ...]:
    return error.code(), error.details(), tuple(error.trailing_metadata())


async def _unary_outcome(channel: grpc.aio.Channel, request: bytes, method: str = "Unary",
                         **options: Any) -> tuple[Any, ...]:
    try:
        return ("ok", await channel.unary_unary(f"/test.S/{method}")(request, **options))
    except grpc.aio.AioRpcError as error:
        return _status(error)


@pytest.mark.parametrize("request_bytes", [
    b"hello", b"raise", b"abort", b"abort-with-status", b"set-code", b"set-code-then-raise",
    b"big", b"x" * 1500])
async def test_unary_answers_and_statuses_are_the_channels(both: Any, request_bytes: bytes
                                                           ) -> None:
    channel, local, real_interceptor, local_interceptor = both
    expected = await _unary_outcome(channel, request_bytes)
    assert await _unary_outcome(local, request_bytes) == expected
    assert real_interceptor.seen == local_interceptor.seen == ["/test.S/Unary"]


async def test_rich_details_and_initial_metadata_arrive_as_over_a_channel(both: Any) -> None:
    channel, local, *_ = both
    refusals = []
    for chan in (channel, local):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await chan.unary_unary("/test.S/Unary")(b"abort-with-status")
        refusals.append(CallError.from_rpc_error(caught.value))
    assert [(r.code, r.message, r.reason) for r in refusals] == [
        (grpc.StatusCode.INVALID_ARGUMENT, "bad", "WHY")] * 2
    initial = []
    for chan in (channel, local):
        call = chan.unary_unary("/test.S/Unary")(b"initial-metadata")
        assert await call == b"after the initial metadata"
        initial.append([item for item in await call.initial_metadata()
                        if item[0].startswith("x-")])
    assert initial == [[("x-first", "1")]] * 2


async def test_an_unknown_method_and_a_sync_handler_answer_as_over_a_channel(both: Any) -> None:
    channel, local, *_ = both
    for method in ("Nope", "Sync"):
        assert (await _unary_outcome(local, b"s", method)
                == await _unary_outcome(channel, b"s", method))
    assert await _unary_outcome(local, b"s", "Sync") == ("ok", b"sync:s")


async def test_a_deadline_ends_the_call_and_is_the_handlers_time_remaining(both: Any) -> None:
    channel, local, *_ = both
    expected = await _unary_outcome(channel, b"hang", timeout=0.2)
    assert expected[0] is grpc.StatusCode.DEADLINE_EXCEEDED
    assert await _unary_outcome(local, b"hang", timeout=0.2) == expected
    seen = json.loads((await _unary_outcome(local, b"context", timeout=30))[1])
    assert seen["remaining"] is True

    DONE[b"then-deadline"] = asyncio.Event()
    call = local.unary_stream("/test.S/Stream")(b"then-deadline", timeout=0.2)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in call:
            pass
    assert caught.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    await asyncio.wait_for(DONE[b"then-deadline"].wait(), 10)
    assert ENDED[b"then-deadline"]["cancelled"] is True
    assert ENDED[b"then-deadline"]["time_remaining"] == 0.0


async def test_streams_and_their_end_are_the_channels(both: Any) -> None:
    channel, local, *_ = both

    async def outcome(chan: grpc.aio.Channel, method: str, request: bytes) -> list[Any]:
        got: list[Any] = []
        call = chan.unary_stream(f"/test.S/{method}")(request)
        try:
            while (message := await call.read()) is not grpc.aio.EOF:
                got.append(message)
        except grpc.aio.AioRpcError as error:
            got.append(_status(error))
        got.append(await call.code())
        return got

    for method, request in (("Stream", b"plain"), ("Stream", b"then-abort"),
                            ("Written", b"")):
        assert await outcome(local, method, request) == await outcome(channel, method, request)


async def test_cancelling_a_stream_cancels_its_handler(both: Any) -> None:
    _, local, *_ = both
    DONE[b"then-hang"] = asyncio.Event()
    call = local.unary_stream("/test.S/Stream")(b"then-hang")
    assert [await call.read() for _ in range(3)] == [b"0", b"1", b"2"]
    assert call.cancel() is True
    with pytest.raises(asyncio.CancelledError):
        await call.read()
    assert await call.code() is grpc.StatusCode.CANCELLED
    assert await call.details() == "Locally cancelled by application!"
    await asyncio.wait_for(DONE[b"then-hang"].wait(), 10)
    assert ENDED[b"then-hang"] == {"cancelled": True, "time_remaining": None,
                                   "done_callback": True}




async def test_cancelling_the_task_awaiting_a_unary_call_cancels_its_handler(both: Any
                                                                           ) -> None:
    _, local, *_ = both
    DONE["hang"], DONE["hang-cancelled"] = asyncio.Event(), asyncio.Event()
    call = local.unary_unary("/test.S/Unary")(b"hang")
    waiting = asyncio.ensure_future(call)
    await asyncio.wait_for(DONE["hang"].wait(), 10)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await asyncio.wait_for(DONE["hang-cancelled"].wait(), 10)
    assert call.cancelled() and await call.code() is grpc.StatusCode.CANCELLED


async def test_closing_the_channel_cancels_its_calls_and_refuses_new_ones(both: Any) -> None:
    _, local, *_ = both
    call = local.unary_stream("/test.S/Stream")(b"then-hang")
    await call.read()
    await local.close()
    with pytest.raises(asyncio.CancelledError):
        await call.read()
    later = local.unary_unary("/test.S/Unary")(b"late")
    with pytest.raises(asyncio.CancelledError):
        await later


async def test_the_callers_context_variables_do_not_reach_the_handler(both: Any) -> None:
    _, local, *_ = both
    CALLER_VARIABLE.set("the bridge's")
    answer = await local.unary_unary("/test.S/Unary")(b"context", metadata=(("k", "v"),))
    assert json.loads(answer) == {"caller_variable": "", "k": "v", "remaining": False}


async def test_metadata_grpc_would_not_send_is_refused_before_any_interceptor(both: Any
                                                                             ) -> None:
    _, local, _, local_interceptor = both
    for metadata in ((("x-request-id", "\xe9"),), (("Authorization", "Bearer k"),),
                     (("x-request-id", "a\x01b"),)):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await local.unary_unary("/test.S/Unary")(b"hello", metadata=metadata)
        assert (caught.value.code(), caught.value.details()) == (
            grpc.StatusCode.INTERNAL, "Invalid metadata")
    assert local_interceptor.seen == []
    answer = await local.unary_unary("/test.S/Unary")(
        b"hello", metadata=(("x-request-id", " spaced "), ("x-blob-bin", b"\xff")))
    assert answer == b"echo:hello"


async def test_a_stopped_server_refuses_in_process_calls(both: Any) -> None:
    _, local, *_ = both
    await local._server.stop()
    status = await _unary_outcome(local, b"hello")
    assert status[0] is grpc.StatusCode.UNAVAILABLE


# -- a stargrpc server: the same refusals, audit and supervision as over its port -------------

async def _execute(stub: tool_service_pb2_grpc.ToolServiceStub, tool: str, arguments: Any,
                   metadata: Any, **options: Any) -> tuple[Any, ...]:
    request = tool_service_pb2.ExecuteRequest(tool_name=tool,
                                              arguments_json=json.dumps(arguments))
    try:
        events = [response.event async for response in stub.Execute(
            request, metadata=metadata, **options)]
    except grpc.aio.AioRpcError as error:
        refused = CallError.from_rpc_error(error)
        return refused.code, refused.message, refused.reason, tuple(refused.violations)
    result = events[-1].result
    return "result", result.outcome, result.output


def _stubs(server: StargrpcServer, channel: grpc.aio.Channel
           ) -> tuple[tool_service_pb2_grpc.ToolServiceStub, tool_service_pb2_grpc.ToolServiceStub]:
    return (tool_service_pb2_grpc.ToolServiceStub(channel),
            tool_service_pb2_grpc.ToolServiceStub(server.inprocess.channel("test")))


async def test_refusals_are_the_same_as_over_the_servers_port(
        make_auth_server: AuthServerFactory) -> None:
    auth = await make_auth_server(mcp_registry(), max_receive_message_bytes=4096)
    cases = {
        "ok": ("echo", {"text": "hi"}, [("authorization", f"Bearer {auth.key}")]),
        "no key": ("echo", {"text": "hi"}, []),
        "bad key": ("echo", {"text": "hi"}, [("authorization", "Bearer sk-nope")]),
        "unknown tool": ("nope", {}, [("authorization", f"Bearer {auth.key}")]),
        "bad argument": ("measure", {"size": "two"}, [("authorization", f"Bearer {auth.key}")]),
        "oversized": ("echo", {"text": "x" * 5000}, [("authorization", f"Bearer {auth.key}")]),
    }
    async with grpc.aio.insecure_channel(auth.target) as channel:
        real, local = _stubs(auth.server, channel)
        for name, (tool, arguments, metadata) in cases.items():
            expected = await _execute(real, tool, arguments, metadata)
            assert await _execute(local, tool, arguments, metadata) == expected, name
        # A method that does not exist: UNIMPLEMENTED once authenticated, both ways.
        for metadata in ([("authorization", f"Bearer {auth.key}")], []):
            statuses = []
            for chan in (channel, auth.server.inprocess.channel("test")):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await chan.unary_unary("/stargrpc.v1.ToolService/Nope")(
                        b"", metadata=metadata)
                statuses.append((caught.value.code(), caught.value.details()))
            assert statuses[0] == statuses[1]
            assert statuses[0][0] is (grpc.StatusCode.UNIMPLEMENTED if metadata
                                      else grpc.StatusCode.UNAUTHENTICATED)
    assert (await _execute(local, "echo", {"text": "x" * 5000}, []))[0] is (
        grpc.StatusCode.RESOURCE_EXHAUSTED)
    # Each case left the same record both ways (the channel's first, then the in-process).
    records = await records_of(auth.server)
    assert len(records) == 2 * len(cases) + 4 + 1
    fields = [(r.method, r.principal, r.outcome, r.detail, r.tool) for r in records]
    assert fields[0::2][:len(cases)] == fields[1::2][:len(cases)]
    # The peer is the transport's (an oversized call is refused before its handler, when
    # the audit has not learnt it yet, both ways).
    assert [r.peer.split(":")[0] for r in records[:2 * len(cases)]] == [
        "ipv4", "inproc"] * (len(cases) - 1) + ["", ""]


async def test_an_in_process_call_is_audited_with_its_principal_outcome_and_peer(
        make_auth_server: AuthServerFactory) -> None:
    auth = await make_auth_server(mcp_registry())
    local = tool_service_pb2_grpc.ToolServiceStub(auth.server.inprocess.channel("test"))
    assert (await _execute(local, "echo", {"text": "audited"},
                           [("authorization", f"Bearer {auth.key}")]))[0] == "result"
    assert (await _execute(local, "echo", {"text": "refused"},
                           [("authorization", "Bearer sk-nope")]))[0] is (
        grpc.StatusCode.UNAUTHENTICATED)

    records = [record for record in await records_of(auth.server)
               if record.method.endswith("/Execute")]
    assert [(r.principal, r.outcome, r.peer, r.tool) for r in records] == [
        ("tester", "ok", "inproc:test", "echo"),
        ("", "unauthenticated", "inproc:test", "echo")]


async def test_the_critic_stops_a_hung_in_process_run_and_a_deadline_reaches_it(
        make_server: ServerFactory) -> None:
    server = await make_server(mcp_registry(), critic_soft_timeout=0.3)
    GATES["critic-inproc"] = asyncio.Event()  # never opened: the run hangs silently
    local = tool_service_pb2_grpc.ToolServiceStub(server.inprocess.channel("test"))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        real = tool_service_pb2_grpc.ToolServiceStub(channel)
        expected = await _execute(real, "pause_at_gate", {"gate": "critic-inproc"}, [])
        assert await _execute(local, "pause_at_gate", {"gate": "critic-inproc"}, []) == expected
        # The caller's deadline is the run's (the critic interceptor reads time_remaining).
        GATES["deadline-inproc"] = asyncio.Event()
        over_the_port = await _ended_by_the_deadline(real, "deadline-inproc")
        in_process = await _ended_by_the_deadline(local, "deadline-inproc")
    assert in_process == over_the_port == (events_pb2.OUTCOME_TIMEOUT, "CLIENT_DEADLINE")


async def _ended_by_the_deadline(stub: tool_service_pb2_grpc.ToolServiceStub, gate: str
                                 ) -> tuple[int, str]:
    """How a run of ``pause_at_gate`` called with a 0.2 s deadline ended (outcome, code).
    With a key it outlives its stream, so only the deadline the server applies can end it;
    its Result, which may come after the client gave up, is read back by a retry with the
    key."""
    request = execute_request("pause_at_gate", {"gate": gate}, idempotency_key=key())
    with contextlib.suppress(grpc.aio.AioRpcError):
        await collect(stub.Execute(request, timeout=0.2))
    result = (await collect(stub.Execute(request, timeout=30)))[-1].result
    return result.outcome, result.error.code


class _Peers(grpc.aio.ServerInterceptor):
    """An embedder's interceptor after the server's chain: notes the peer of each Execute."""

    def __init__(self) -> None:
        self.peers: list[str] = []

    async def intercept_service(self, continuation: Callable[..., Any],
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(handler_call_details)
        if not handler_call_details.method.endswith("/Execute"):
            return handler
        inner = handler.unary_stream

        async def noted(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            self.peers.append(context.peer())
            async for response in inner(request, context):
                yield response

        return grpc.unary_stream_rpc_method_handler(
            noted, handler.request_deserializer, handler.response_serializer)


async def test_a_header_grpc_cannot_carry_is_left_out_and_the_call_served(
        make_server: ServerFactory) -> None:
    # A forwarded header whose value is no gRPC metadata value is dropped (it was the
    # channel's 500 "Invalid metadata"); credentials of that kind are refused as such.
    server = await make_server(mcp_registry(), http_port=0)
    async with httpx2.AsyncClient(
            base_url=f"http://127.0.0.1:{server.http.gateway_port}", timeout=30) as http:
        answer = await http.post("/v1/tools/echo:execute?wait=true",
                                 json={"arguments": {"text": "x"}},
                                 headers=[(b"x-request-id", b"\xe9")])
    assert answer.status_code == 200, answer.text
    assert answer.json()["result"]["output"] == "x"


async def test_front_ends_call_in_process_through_every_interceptor_and_cancel_runs(
        make_server: ServerFactory, tmp_path: Path) -> None:
    peers = _Peers()
    settings = Settings.load(insecure_no_auth=True, state_dir=tmp_path / "state")
    server = await make_server(mcp_registry(), interceptors=[*build_chain(settings), peers],
                               mcp_port=0, http_port=0)
    assert server.mcp is not None
    # A client of the in-process channel going away (as the bridge does) cancels its run.
    GATES["cancel-inproc"], CANCELLED["cancel-inproc"] = asyncio.Event(), asyncio.Event()
    client = GatewayClient("unused", channel=server.inprocess.channel("test"))
    await client.start()
    started = await client.start_run(tool_service_pb2.ExecuteRequest(
        tool_name="wait_at_gate", arguments_json=json.dumps({"gate": "cancel-inproc"})),
        [], listen=True)
    await client.aclose()
    await asyncio.wait_for(CANCELLED["cancel-inproc"].wait(), 10)
    assert started.run_id
    # An MCP call and a gateway call: each an in-process Execute named by its front end.
    async with httpx2.AsyncClient(timeout=30) as http, Client(streamable_http_client(
            f"http://127.0.0.1:{server.mcp.port}/mcp", http_client=http),  # type: ignore[arg-type]
            mode="legacy") as mcp:
        answer = await mcp.call_tool("echo", {"text": "over mcp"})
    assert not answer.is_error
    async with httpx2.AsyncClient(
            base_url=f"http://127.0.0.1:{server.http.gateway_port}", timeout=30) as http:
        ran = await http.post("/v1/tools/echo:execute?wait=true",
                              json={"arguments": {"text": "over http"}})
    assert ran.status_code == 200

    assert peers.peers == ["inproc:test", "inproc:mcp", "inproc:gateway"]
    records = [record for record in await records_of(server)
               if record.method.endswith("/Execute")]
    # The front ends vouch for their HTTP client, which the audit records as before.
    assert [(r.outcome, r.peer) for r in records] == [
        ("cancelled", "inproc:test"), ("ok", "ipv4:127.0.0.1"), ("ok", "ipv4:127.0.0.1")]
