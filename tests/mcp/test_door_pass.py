"""An MCP request is authenticated once, at the endpoint's door: the bridge's gRPC calls
carry the door pass beside the caller's credentials (stargrpc.server.interceptors.door_pass),
the gRPC call is still audited once, as the caller, and what the bridge sends is worth
nothing to anyone who sends it without the caller's credentials."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import grpc
import jwt
import pytest

from stargrpc.gateway.client import Metadata
from stargrpc.mcp.sessions import MCP_AUDIT_METHOD
from stargrpc.server.interceptors.audit import AuditInterceptor
from stargrpc.server.interceptors.door_pass import DOOR_PASS_METADATA
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.conftest import AuthServerFactory
from tests.helpers import count_authentications
from tests.mcp.conftest import McpUnderTest
from tests.mcp.mcp_tools import mcp_registry

SECRET = "a-door-pass-test-secret-long-enough-for-hs256"
ISSUER, AUDIENCE = "https://idp.example", "stargrpc"


def _capture_bridge_metadata(server: McpUnderTest, monkeypatch: pytest.MonkeyPatch
                             ) -> list[Metadata]:
    """The metadata of each of the bridge's gRPC calls, as it sends them."""
    endpoint = server.auth.server.mcp
    assert endpoint is not None
    bridge = endpoint._bridge
    sent: list[Metadata] = []
    credentials: Callable[[Any], Metadata] = bridge._credentials

    def capturing(ctx: Any) -> Metadata:
        metadata = credentials(ctx)
        sent.append(metadata)
        return metadata

    monkeypatch.setattr(bridge, "_credentials", capturing)
    return sent


async def _records(server: McpUnderTest) -> list[Any]:
    audit = next(i for i in server.auth.server.interceptors if isinstance(i, AuditInterceptor))
    await audit.writer.flush()
    return [r async for r in audit.writer.store.scan()]


async def _whoami_over_grpc(target: str, metadata: Metadata) -> str:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        events = [reply.event async for reply in stub.Execute(
            tool_service_pb2.ExecuteRequest(tool_name="whoami"), metadata=metadata)]
    assert events[-1].result.outcome == events_pb2.OUTCOME_OK, events[-1]
    return events[-1].result.output


@pytest.mark.parametrize("tool", ["whoami", "echo"])
async def test_a_call_is_authenticated_once_and_audited_once_as_its_caller(
        mcp_server: McpUnderTest, monkeypatch: pytest.MonkeyPatch, tool: str) -> None:
    requests: list[str] = []

    async def seen(request: Any) -> None:
        requests.append(request.method)

    async with mcp_server.client(mode="2026-07-28", event_hooks={"request": [seen]}) as client:
        checked = count_authentications(mcp_server.auth.server, monkeypatch)
        requests.clear()
        result = await client.call_tool(tool, {"text": "once"} if tool == "echo" else {})

    assert not result.is_error, result
    if tool == "whoami":
        assert result.content[0].text == "tester api_key admin"  # type: ignore[union-attr]
    assert len(checked) == len(requests) >= 1  # the door's checks; none on the gRPC side
    executes = [r for r in await _records(mcp_server) if r.method.endswith("/Execute")]
    assert [(r.principal, r.outcome, r.peer) for r in executes] == [
        ("tester", "ok", "ipv4:127.0.0.1")]
    assert executes[0].tool == tool
    assert not [r for r in await _records(mcp_server) if r.method.startswith(MCP_AUDIT_METHOD)]


async def test_a_jwt_caller_is_verified_once_and_keeps_its_identity(
        make_auth_server: AuthServerFactory, tmp_path: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    tools = tmp_path / "tools"
    tools.mkdir()
    server = McpUnderTest(await make_auth_server(
        mcp_registry(), mcp_port=0, tools_dir=[tools], jwt_secret=SECRET, jwt_issuer=ISSUER,
        jwt_audience=AUDIENCE))
    now = int(time.time())
    token = jwt.encode({"sub": "user-1", "iss": ISSUER, "aud": AUDIENCE, "iat": now,
                        "exp": now + 300, "roles": ["ops", "reader"]}, SECRET,
                       algorithm="HS256")
    requests: list[str] = []

    async def seen(request: Any) -> None:
        requests.append(request.method)

    async with server.client(key=token, mode="2026-07-28",
                             event_hooks={"request": [seen]}) as client:
        checked = count_authentications(server.auth.server, monkeypatch)
        requests.clear()
        result = await client.call_tool("whoami", {})

    assert result.content[0].text == "user-1 jwt ops,reader"  # type: ignore[union-attr]
    assert len(checked) == len(requests)
    executes = [r for r in await _records(server) if r.method.endswith("/Execute")]
    assert [r.principal for r in executes] == ["user-1"]


@pytest.mark.parametrize("mode", ["legacy", "2026-07-28"])
async def test_what_the_bridge_sends_is_worthless_without_the_callers_credentials(
        mcp_server: McpUnderTest, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    sent = _capture_bridge_metadata(mcp_server, monkeypatch)
    async with mcp_server.client(mode=mode) as client:
        await client.call_tool("whoami", {})
    passed = [m for m in sent if any(name == DOOR_PASS_METADATA for name, _ in m)]
    assert passed, sent
    copied = list(passed[-1])
    without_credentials = [(name, value) for name, value in copied if name != "authorization"]
    bob = mcp_server.auth.add_key("bob", "reader")
    target = mcp_server.auth.target

    # The whole of it: it names the caller whose credentials are in it, nothing more.
    assert await _whoami_over_grpc(target, copied) == "tester api_key admin"
    # Without the caller's credentials: nobody.
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _whoami_over_grpc(target, without_credentials)
    assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED
    # Beside someone else's: that someone, with their own roles.
    assert await _whoami_over_grpc(
        target, [*without_credentials, ("authorization", f"Bearer {bob}")]) == \
        "bob api_key reader"
