"""The authentication interceptor, through real servers: who gets in, what they learn when
they do not, and what the rest of the call sees."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from stargrpc import metrics
from stargrpc.auth import KeyStore
from stargrpc.principal import current_principal
from stargrpc.runs.call_record import CallRecord, current_call
from stargrpc.server.interceptors.auth import AuthInterceptor
from stargrpc.settings import Settings
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.auth_tools import auth_registry
from tests.helpers import key_channel, run_tool, status_details

GENERIC = "missing or invalid credentials"


def failures(cause: str) -> float:
    """How many calls the auth-failure metric has counted for ``cause``."""
    return metrics.REGISTRY.get_sample_value("tool_executor_auth_failures_total",
                                             {"reason": cause}) or 0.0


async def refusal(target: str, metadata: tuple[tuple[str, str], ...]) -> grpc.aio.AioRpcError:
    """The error of an Execute of whoami with ``metadata``."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        request = tool_service_pb2.ExecuteRequest(tool_name="whoami")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            _ = [r async for r in stub.Execute(request, metadata=metadata)]
    return caught.value


async def test_a_key_authenticates_as_its_name_with_its_roles(make_auth_server) -> None:
    auth = await make_auth_server(auth_registry(), roles=["ops", "reader"])

    async with key_channel(auth.target, auth.key) as channel:
        events = await run_tool(tool_service_pb2_grpc.ToolServiceStub(channel), "whoami", {})

    assert events[-1].result.outcome == events_pb2.OUTCOME_OK
    assert events[-1].result.output == "tester api_key ops,reader"


async def test_every_bad_credential_gets_the_same_bare_unauthenticated(
        make_auth_server) -> None:
    auth = await make_auth_server(auth_registry())
    revoked = auth.add_key("gone", "admin")
    auth.keys.revoke("gone")
    wrong_secret = auth.key[:-4] + ("AAAA" if not auth.key.endswith("AAAA") else "BBBB")
    cases = {
        "missing": (),
        "malformed_header": (("authorization", f"Basic {auth.key}"),),
        "malformed_key": (("authorization", "Bearer sgk_nothing"),),
        "unknown_token_kind": (("authorization", "Bearer abc.def.ghi"),),
        "unknown_key": (("authorization", f"Bearer {wrong_secret}"),),
        "revoked_key": (("authorization", f"Bearer {revoked}"),),
    }
    for cause, metadata in cases.items():
        before = failures(cause)

        error = await refusal(auth.target, metadata)

        assert error.code() == grpc.StatusCode.UNAUTHENTICATED, cause
        assert error.details() == GENERIC, cause
        assert status_details(error) == [], cause
        assert failures(cause) == before + 1, cause


async def test_revoking_a_key_takes_effect_on_the_next_call(make_auth_server) -> None:
    auth = await make_auth_server(auth_registry())
    async with key_channel(auth.target, auth.key) as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        assert (await run_tool(stub, "whoami", {}))[-1].result.outcome == events_pb2.OUTCOME_OK

        assert [k.name for k in auth.keys.revoke("tester")] == ["tester"]

        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await run_tool(stub, "whoami", {})
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_a_key_added_while_serving_works_at_once(make_auth_server) -> None:
    auth = await make_auth_server(auth_registry())
    key = auth.add_key("late", "reader")

    async with key_channel(auth.target, key) as channel:
        events = await run_tool(tool_service_pb2_grpc.ToolServiceStub(channel), "whoami", {})

    assert events[-1].result.output == "late api_key reader"


async def test_health_and_reflection_need_no_credentials_by_default(make_auth_server) -> None:
    auth = await make_auth_server()
    async with grpc.aio.insecure_channel(auth.target) as channel:
        health = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest())
        services = await list_services(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await tool_service_pb2_grpc.ToolServiceStub(channel).ListTools(
                tool_service_pb2.ListToolsRequest())

    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert "stargrpc.v1.ToolService" in services
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_health_and_reflection_can_require_credentials(make_auth_server) -> None:
    auth = await make_auth_server(auth_open_health=False, auth_open_reflection=False)
    async with grpc.aio.insecure_channel(auth.target) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as health_refused:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        with pytest.raises(grpc.aio.AioRpcError) as reflection_refused:
            await list_services(channel)
    async with key_channel(auth.target, auth.key) as channel:
        health = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest())
        services = await list_services(channel)  # a bidirectional stream, authenticated

    assert health_refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert reflection_refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert "stargrpc.v1.ToolService" in services


async def list_services(channel: grpc.aio.Channel) -> list[str]:
    """The services server reflection lists."""
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
        list_services="")]))
    return [service.name async for reply in call
            for service in reply.list_services_response.service]


async def test_an_unknown_method_needs_credentials_before_it_is_unimplemented(
        make_auth_server) -> None:
    auth = await make_auth_server()
    method = "/stargrpc.v1.ToolService/NoSuchMethod"
    async with grpc.aio.insecure_channel(auth.target) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as anonymous:
            await channel.unary_unary(method)(b"")
    async with key_channel(auth.target, auth.key) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as known:
            await channel.unary_unary(method)(b"")

    assert anonymous.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert known.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_without_authentication_the_caller_is_local_and_holds_every_role(
        make_server) -> None:
    server = await make_server(auth_registry())  # the test default: insecure_no_auth
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        whoami = await run_tool(stub, "whoami", {})
        privileged = await run_tool(stub, "danger", {})
        ops = await run_tool(stub, "ops_only", {})

    assert whoami[-1].result.output == "local none *"
    assert privileged[-1].result.outcome == events_pb2.OUTCOME_OK
    assert ops[-1].result.outcome == events_pb2.OUTCOME_OK


# -- the call record ------------------------------------------------------------------------


class OpensRecords(grpc.aio.ServerInterceptor):
    """Stands in for the audit interceptor: opens a CallRecord per call and keeps it."""

    def __init__(self) -> None:
        self.records: list[CallRecord] = []

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        record = CallRecord(method=details.method)
        self.records.append(record)
        current_call.set(record)
        return await continuation(details)


async def test_the_call_record_gets_the_principal_or_unauthenticated(
        make_auth_server, tmp_path) -> None:
    opener = OpensRecords()
    keys_file = tmp_path / "keys.json"
    settings = Settings(insecure_no_auth=False, keys_file=keys_file, state_dir=tmp_path)
    auth = await make_auth_server(auth_registry(), roles=["delegate"], keys_file=keys_file,
                                  interceptors=[opener, AuthInterceptor(settings)])

    await refusal(auth.target, ())
    async with key_channel(auth.target, auth.key) as channel:
        events = await run_tool(tool_service_pb2_grpc.ToolServiceStub(channel), "whoami", {},
                                context=tool_service_pb2.InvocationContext(end_user="bob"))

    refused, admitted = opener.records
    assert refused.outcome == "unauthenticated"
    assert refused.principal is None
    assert refused.detail == "credentials refused: missing"
    assert admitted.principal is not None
    assert admitted.principal.describe() == "tester acting for bob"
    assert admitted.tool == "whoami"
    assert events[-1].result.output == "tester acting for bob api_key delegate"


# -- every call shape ---------------------------------------------------------------------


def _shape_handlers(ran: list[str]) -> grpc.GenericRpcHandler:
    """One method of each shape; each answers with the principal it saw."""

    def who() -> bytes:
        return current_principal.get().id.encode()

    async def unary_unary(request: bytes, context: Any) -> bytes:
        ran.append("unary_unary")
        return who()

    async def unary_stream(request: bytes, context: Any) -> AsyncIterator[bytes]:
        ran.append("unary_stream")
        yield who()
        yield who()

    async def unary_stream_writer(request: bytes, context: Any) -> None:
        ran.append("unary_stream_writer")
        await context.write(who())

    async def stream_unary(requests: AsyncIterator[bytes], context: Any) -> bytes:
        ran.append("stream_unary")
        count = len([r async for r in requests])
        return who() + str(count).encode()

    async def stream_stream(requests: AsyncIterator[bytes], context: Any
                            ) -> AsyncIterator[bytes]:
        ran.append("stream_stream")
        async for request in requests:
            yield who() + request

    def sync_unary(request: bytes, context: Any) -> bytes:
        ran.append("sync_unary")
        return who()

    return grpc.method_handlers_generic_handler("test.Shapes", {
        "UnaryUnary": grpc.unary_unary_rpc_method_handler(unary_unary),
        "UnaryStream": grpc.unary_stream_rpc_method_handler(unary_stream),
        "UnaryStreamWriter": grpc.unary_stream_rpc_method_handler(unary_stream_writer),
        "StreamUnary": grpc.stream_unary_rpc_method_handler(stream_unary),
        "StreamStream": grpc.stream_stream_rpc_method_handler(stream_stream),
        "SyncUnary": grpc.unary_unary_rpc_method_handler(sync_unary),
    })


async def _call_every_shape(channel: grpc.aio.Channel) -> dict[str, Any]:
    return {
        "unary_unary": await channel.unary_unary("/test.Shapes/UnaryUnary")(b""),
        "unary_stream": [r async for r in channel.unary_stream("/test.Shapes/UnaryStream")(b"")],
        "unary_stream_writer": [r async for r in channel.unary_stream(
            "/test.Shapes/UnaryStreamWriter")(b"")],
        "stream_unary": await channel.stream_unary("/test.Shapes/StreamUnary")(
            iter([b"a", b"b"])),
        "stream_stream": [r async for r in channel.stream_stream("/test.Shapes/StreamStream")(
            iter([b"1", b"2"]))],
        "sync_unary": await channel.unary_unary("/test.Shapes/SyncUnary")(b""),
    }


async def test_every_call_shape_is_guarded_and_sees_the_principal(tmp_path) -> None:
    keys_file = tmp_path / "keys.json"
    settings = Settings(insecure_no_auth=False, keys_file=keys_file, state_dir=tmp_path)
    key = KeyStore(keys_file).create("shaper", ["x"])[1]
    ran: list[str] = []
    server = grpc.aio.server(interceptors=[AuthInterceptor(settings)])
    server.add_generic_rpc_handlers((_shape_handlers(ran),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            for name, call in {
                "unary_unary": lambda: channel.unary_unary("/test.Shapes/UnaryUnary")(b""),
                "stream_unary": lambda: channel.stream_unary("/test.Shapes/StreamUnary")(
                    iter([b"a"])),
            }.items():
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call()
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
            for method in ("UnaryStream", "UnaryStreamWriter"):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    _ = [r async for r in channel.unary_stream(f"/test.Shapes/{method}")(b"")]
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED, method
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                _ = [r async for r in channel.stream_stream("/test.Shapes/StreamStream")(
                    iter([b"1"]))]
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert ran == []  # no handler ran for an unauthenticated call

        async with key_channel(f"127.0.0.1:{port}", key) as channel:
            answers = await _call_every_shape(channel)
    finally:
        await server.stop(None)

    assert answers == {
        "unary_unary": b"shaper",
        "unary_stream": [b"shaper", b"shaper"],
        "unary_stream_writer": [b"shaper"],
        "stream_unary": b"shaper2",
        "stream_stream": [b"shaper1", b"shaper2"],
        "sync_unary": b"shaper",
    }
    assert sorted(ran) == sorted(answers)
