"""The one way through the audit, auth and critic interceptors: each is the composed
interceptor with only its own stage; a server serves neighbouring stages as one; an
embedder's interceptor between two of them splits the run there and sees the call between
the two."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from stargrpc.audit.record import AuditRecord
from stargrpc.contract import SERVICE_NAME
from stargrpc.principal import current_principal
from stargrpc.runs.call_record import current_call
from stargrpc.server.interceptors import build_chain
from stargrpc.server.interceptors.audit import AuditInterceptor
from stargrpc.server.interceptors.auth import AuthInterceptor
from stargrpc.server.interceptors.composed import ComposedInterceptor, compose
from stargrpc.server.interceptors.critic import CriticInterceptor
from stargrpc.server.interceptors.tracing import TracingInterceptor
from stargrpc.settings import Settings
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.auth_tools import auth_registry
from tests.helpers import eventually, key_channel, run_tool

EXECUTE = f"/{SERVICE_NAME}/Execute"


async def _records(audit: AuditInterceptor) -> list[AuditRecord]:
    # A client may hold its status before its call's record is handed over (as the
    # handler unwinds): every record handed over first, then written.
    await eventually(lambda: audit.open_calls == 0, what="every record handed over")
    await audit.writer.flush()
    return [record async for record in audit.writer.store.scan()]


class _Observer(grpc.aio.ServerInterceptor):
    """An embedder's interceptor: notes, as each Execute's handler starts, which record is
    open and who the principal is."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler | None]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or handler.unary_stream is None:
            return handler
        inner, seen = handler.unary_stream, self.seen

        async def observed(request: Any, context: grpc.aio.ServicerContext
                           ) -> AsyncIterator[Any]:
            record = current_call.get()
            seen.append((record.method if record else "", current_principal.get().id))
            async for response in inner(request, context):
                yield response

        return grpc.unary_stream_rpc_method_handler(
            observed, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)


def test_each_interceptor_is_the_composed_one_with_only_its_own_stage(tmp_path: Path) -> None:
    audit, auth, critic = build_chain(Settings(state_dir=tmp_path))

    assert isinstance(audit, AuditInterceptor) and audit.stages == (audit, None, None)
    assert isinstance(auth, AuthInterceptor) and auth.stages == (None, auth, None)
    assert isinstance(critic, CriticInterceptor) and critic.stages == (None, None, critic)


def test_compose_serves_neighbouring_stages_as_one_and_leaves_the_rest(tmp_path: Path
                                                                        ) -> None:
    settings = Settings(state_dir=tmp_path, tracing=True, tracing_exporter="none")
    tracing, audit, auth, critic = build_chain(settings)
    assert isinstance(tracing, TracingInterceptor)

    [outer, composed] = compose([tracing, audit, auth, critic])
    assert outer is tracing
    assert isinstance(composed, ComposedInterceptor)
    assert composed.stages == (audit, auth, critic)

    # Without auth (the bench's "auth off" chain), and without the audit.
    [no_auth] = compose([audit, critic])
    assert no_auth.stages == (audit, None, critic)  # type: ignore[attr-defined]
    [no_audit] = compose([auth, critic])
    assert no_audit.stages == (None, auth, critic)  # type: ignore[attr-defined]
    # Out of their order each is served as it is, where it is.
    assert compose([auth, audit]) == [auth, audit]
    assert compose([critic, auth, audit]) == [critic, auth, audit]

    # An embedder's interceptor between two stages stays between them.
    mine = _Observer()
    [first, middle, rest] = compose([audit, mine, auth, critic])
    assert (first, middle) == (audit, mine)
    assert rest.stages == (None, auth, critic)  # type: ignore[attr-defined]

    # A subclass that serves calls its own way is left as it is.
    class Logged(AuditInterceptor):
        async def intercept_service(self, continuation: Any, details: Any) -> Any:
            return await super().intercept_service(continuation, details)

    logged = Logged(settings)
    [own, pair] = compose([logged, auth, critic])
    assert own is logged and pair.stages == (None, auth, critic)  # type: ignore[attr-defined]


async def test_a_composed_server_records_and_refuses_as_the_chain_does(make_auth_server
                                                                        ) -> None:
    auth = await make_auth_server(auth_registry(), roles=["ops", "reader"])
    server = auth.server
    audit = next(i for i in server.interceptors if isinstance(i, AuditInterceptor))
    method = f"/{SERVICE_NAME}/NoSuchMethod"
    request = tool_service_pb2.ExecuteRequest(tool_name="whoami")

    async with grpc.aio.insecure_channel(auth.target) as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            _ = [r async for r in stub.Execute(request)]
        with pytest.raises(grpc.aio.AioRpcError) as probing:
            await channel.unary_unary(method)(b"")
    async with key_channel(auth.target, auth.key) as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        events = await run_tool(stub, "whoami", {})
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await channel.unary_unary(method)(b"")

    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert probing.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert missing.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert events[-1].result.outcome == events_pb2.OUTCOME_OK
    # The supervision policy reached the run: every event carries the critic's countdown.
    assert all(event.HasField("critic_time_left") for event in events)

    records = await _records(audit)
    assert [(r.method.rsplit("/", 1)[1], r.outcome, r.principal) for r in records] == [
        ("Execute", "unauthenticated", ""),
        ("NoSuchMethod", "unauthenticated", ""),
        ("Execute", "ok", "tester"),
        ("NoSuchMethod", "invalid", "tester"),
    ]
    assert records[2].run_id == events[-1].run_id


async def test_an_embedders_interceptor_between_audit_and_auth_sees_the_call_in_between(
        make_auth_server, tmp_path: Path) -> None:
    keys_file = tmp_path / "keys.json"
    settings = Settings.load(state_dir=tmp_path / "state", insecure_no_auth=False,
                             keys_file=keys_file)
    audit, auth_interceptor, critic = build_chain(settings)
    mine = _Observer()
    auth = await make_auth_server(auth_registry(), keys_file=keys_file,
                                  interceptors=[audit, mine, auth_interceptor, critic])
    assert auth.server.interceptors == [audit, mine, auth_interceptor, critic]
    assert isinstance(audit, AuditInterceptor)

    async with grpc.aio.insecure_channel(auth.target) as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await run_tool(stub, "whoami", {})
    async with key_channel(auth.target, auth.key) as channel:
        events = await run_tool(tool_service_pb2_grpc.ToolServiceStub(channel), "whoami", {})

    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert events[-1].result.outcome == events_pb2.OUTCOME_OK
    assert events[-1].result.output.startswith("tester ")
    assert all(event.HasField("critic_time_left") for event in events)
    # Inside the audit's record, before authentication: each call, refused or not.
    assert mine.seen == [(EXECUTE, "anonymous"), (EXECUTE, "anonymous")]
    records = await _records(audit)
    assert [(r.outcome, r.principal) for r in records] == [
        ("unauthenticated", ""), ("ok", "tester")]
