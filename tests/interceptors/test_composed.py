"""The audit, auth and critic interceptors served as one: the same calls, the same records
and refusals as the three chained, through one wrapper."""

from __future__ import annotations

import grpc
import pytest

from stargrpc.audit.record import AuditRecord
from stargrpc.interceptors import build_chain
from stargrpc.interceptors.audit import AuditInterceptor
from stargrpc.interceptors.auth import AuthInterceptor
from stargrpc.interceptors.composed import ComposedInterceptor, compose
from stargrpc.interceptors.critic import CriticInterceptor
from stargrpc.interceptors.tracing import TracingInterceptor
from stargrpc.settings import Settings
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.auth_tools import auth_registry
from tests.helpers import key_channel, run_tool


async def _records(audit: AuditInterceptor) -> list[AuditRecord]:
    await audit.writer.flush()
    return [record async for record in audit.writer.store.scan()]


def test_compose_serves_audit_auth_and_critic_as_one_and_leaves_the_rest(tmp_path) -> None:
    settings = Settings(state_dir=tmp_path, tracing=True, tracing_exporter="none")
    tracing, audit, auth, critic = build_chain(settings)
    assert isinstance(tracing, TracingInterceptor)

    [outer, composed] = compose([tracing, audit, auth, critic])
    assert outer is tracing
    assert isinstance(composed, ComposedInterceptor)
    assert (composed.audit, composed.auth, composed.critic) == (audit, auth, critic)

    # Without auth (the bench's "auth off" chain), and in an order it does not know.
    [no_auth] = compose([audit, critic])
    assert isinstance(no_auth, ComposedInterceptor) and no_auth.auth is None
    assert [type(i) for i in compose([auth, audit])] == [AuthInterceptor, ComposedInterceptor]
    assert compose([auth, critic]) == [auth, critic]
    assert isinstance(critic, CriticInterceptor)


async def test_a_composed_server_records_and_refuses_as_the_chain_does(make_auth_server
                                                                        ) -> None:
    auth = await make_auth_server(auth_registry(), roles=["ops", "reader"])
    server = auth.server
    audit = next(i for i in server.interceptors if isinstance(i, AuditInterceptor))
    method = "/stargrpc.v1.ToolService/NoSuchMethod"
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
