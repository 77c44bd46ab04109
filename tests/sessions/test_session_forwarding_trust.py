"""What crosses between replicas when a session's call is forwarded: two replicas (and a
fake one) on the real Redis. The caller's credentials never leave the replica they were
presented to; the owner runs a forwarded call only on a signed assertion bound to that one
request; anything else carrying the forwarded header is refused UNAUTHENTICATED and runs
nothing."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import jwt
import pytest

from stargrpc.auth.fleet import FORWARDED_HEADER, FleetAssertions, request_digest
from stargrpc.contract import SERVICE_NAME
from stargrpc.principal import Principal
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.auth.certs import TestCA
from tests.auth.fleet_helpers import edited
from tests.helpers import as_dict, key_channel, records_of, run_tool
from tests.sessions.fleet_helpers import (
    FLEET_SECRET,
    Fleet,
    MetadataRecorder,
    stub_of,
    target,
)
from tests.sessions.session_helpers import create, python, reason

EXECUTE = f"/{SERVICE_NAME}/Execute"


@pytest.fixture
def fleet(make_server, redis_prefix, tmp_path) -> Fleet:
    return Fleet(make_server, redis_prefix, tmp_path)


def execute(session_id: str, code: str) -> tool_service_pb2.ExecuteRequest:
    return tool_service_pb2.ExecuteRequest(tool_name="python", session_id=session_id,
                                           arguments_json=json.dumps({"code": code}))


async def value_of(stub: tool_service_pb2_grpc.ToolServiceStub, session_id: str,
                   expression: str) -> Any:
    result = await python(stub, session_id, expression)
    assert result.outcome == events_pb2.OUTCOME_OK, result
    return as_dict(result)["structured_output"]


async def test_the_owner_receives_an_assertion_and_never_the_callers_token(fleet) -> None:
    recorder = MetadataRecorder()
    owner = await fleet.replica(recorder=recorder)
    other = await fleet.replica()
    token = fleet.keys["alice"]
    async with key_channel(target(owner), token) as on_owner, \
            key_channel(target(other), token) as on_other:
        session_id = await create(stub_of(on_owner))
        await python(stub_of(on_owner), session_id, "x = 20")
        recorder.calls.clear()
        events = await run_tool(stub_of(on_other), "python", {"code": "x + 22"},
                                session_id=session_id)
        assert events[-1].result.outcome == events_pb2.OUTCOME_OK
        assert as_dict(events[-1].result)["structured_output"] == 42
        started = await stub_of(on_other).StartRun(tool_service_pb2.StartRunRequest(
            tool_name="python", arguments_json='{"code": "x"}', session_id=session_id))
        assert started.run_id
        await stub_of(on_other).CloseSession(tool_service_pb2.CloseSessionRequest(
            session_id=session_id))
    forwarded = [(method, metadata) for method, metadata in recorder.calls
                 if FORWARDED_HEADER in metadata]
    assert [method.rpartition("/")[2] for method, _ in forwarded] == \
        ["Execute", "StartRun", "CloseSession"]
    for _, metadata in forwarded:
        assert "authorization" not in metadata
        assert all(token not in str(value) and token.split("_")[-1] not in str(value)
                   for value in metadata.values())
    # The owner's trail: the caller as the other replica authenticated it, and where from.
    records = [r for r in await records_of(owner) if r.method == EXECUTE]
    record = records[-1]
    assert (record.principal, record.auth_method, record.outcome) == ("alice", "api_key", "ok")
    assert f"forwarded from replica {target(other)}" in record.detail
    assert record.peer.startswith("ipv4:127.0.0.1:")
    sent = [r for r in await records_of(other) if r.method == EXECUTE]
    assert f"forwarded to replica {target(owner)}" in sent[-1].detail
    assert sent[-1].principal == "alice"
    assert record.peer == sent[-1].peer  # the caller, as the replica it called saw it


async def test_without_the_fleet_secret_forwarding_is_refused_precisely(fleet) -> None:
    recorder = MetadataRecorder()
    owner = await fleet.replica(recorder=recorder, fleet_secret=None)
    other = await fleet.replica(fleet_secret=None)
    async with key_channel(target(owner), fleet.keys["alice"]) as on_owner, \
            key_channel(target(other), fleet.keys["alice"]) as on_other:
        session_id = await create(stub_of(on_owner))
        await python(stub_of(on_owner), session_id, "x = 1")
        recorder.calls.clear()
        attempts = [
            lambda: python(stub_of(on_other), session_id, "x = 2"),
            lambda: stub_of(on_other).StartRun(tool_service_pb2.StartRunRequest(
                tool_name="python", arguments_json='{"code": "x = 2"}',
                session_id=session_id)),
            lambda: stub_of(on_other).CloseSession(tool_service_pb2.CloseSessionRequest(
                session_id=session_id)),
        ]
        for attempt in attempts:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await attempt()
            assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert reason(caught.value) == "SESSION_FORWARDING_UNCONFIGURED"
            assert "fleet_secret" in (caught.value.details() or "")
        assert recorder.calls == []  # nothing was sent to the owner, no token relayed
        assert await value_of(stub_of(on_owner), session_id, "x") == 1


async def test_a_jwt_caller_is_forwarded(fleet) -> None:
    secret, issuer, audience = "a-jwt-secret-that-is-long-enough-for-hs256", "https://idp", "sg"
    jwt_settings = {"jwt_secret": secret, "jwt_issuer": issuer, "jwt_audience": audience}
    owner = await fleet.replica(**jwt_settings)
    other = await fleet.replica(**jwt_settings)
    now = int(time.time())
    token = jwt.encode({"sub": "carol", "iss": issuer, "aud": audience, "iat": now,
                        "exp": now + 300, "roles": ["ops"]}, secret, algorithm="HS256")
    async with key_channel(target(owner), token) as on_owner, \
            key_channel(target(other), token) as on_other:
        session_id = await create(stub_of(on_owner))
        await python(stub_of(on_owner), session_id, "x = 'kept'")
        assert await value_of(stub_of(on_other), session_id, "x") == "kept"
    record = [r for r in await records_of(owner) if r.method == EXECUTE][-1]
    assert (record.principal, record.auth_method) == ("carol", "jwt")


async def test_an_mtls_caller_is_forwarded(fleet, tmp_path) -> None:
    ca = TestCA()
    files = ca.server_files(tmp_path)
    replica_cert = ca.client("replica")
    (tmp_path / "replica.pem").write_bytes(replica_cert.cert)
    (tmp_path / "replica.key").write_bytes(replica_cert.key)
    tls = {**files, "mtls_roles": {"agent-1": ["ops"]},
           "session_forward_cert_file": tmp_path / "replica.pem",
           "session_forward_key_file": tmp_path / "replica.key",
           "session_forward_ca_file": files["tls_client_ca_file"]}
    owner = await fleet.replica(**tls)
    other = await fleet.replica(**tls)
    agent = ca.client("agent-1")
    credentials = grpc.ssl_channel_credentials(root_certificates=ca.cert,
                                               private_key=agent.key,
                                               certificate_chain=agent.cert)
    async with grpc.aio.secure_channel(target(owner), credentials) as on_owner, \
            grpc.aio.secure_channel(target(other), credentials) as on_other:
        session_id = await create(stub_of(on_owner))
        await python(stub_of(on_owner), session_id, "x = 'by certificate'")
        assert await value_of(stub_of(on_other), session_id, "x") == "by certificate"
    record = [r for r in await records_of(owner) if r.method == EXECUTE][-1]
    assert (record.principal, record.auth_method) == ("agent-1", "mtls")
    assert f"forwarded from replica {target(other)}" in record.detail


def refused(error: grpc.aio.AioRpcError) -> bool:
    return (error.code() == grpc.StatusCode.UNAUTHENTICATED
            and error.details() == "missing or invalid credentials")


async def send(channel: grpc.aio.Channel, request: tool_service_pb2.ExecuteRequest,
               metadata: Sequence[tuple[str, str]]) -> list[events_pb2.RunEvent]:
    return [r.event async for r in stub_of(channel).Execute(request, metadata=metadata)]


async def test_tampered_replayed_or_misplaced_assertions_run_nothing(fleet) -> None:
    owner = await fleet.replica()
    other = await fleet.replica()
    async with key_channel(target(owner), fleet.keys["alice"]) as on_owner:
        session_id = await create(stub_of(on_owner))
        await python(stub_of(on_owner), session_id, "hits = []")
    # The test plays a replica of the fleet (it holds the secret): it vouches for alice.
    replica = FleetAssertions(FLEET_SECRET, lambda: "127.0.0.1:1")
    alice = Principal(id="alice", roles=frozenset({"admin"}), method="api_key")

    def vouch(request: tool_service_pb2.ExecuteRequest, *, to: str = target(owner),
              method: str = EXECUTE, maker: FleetAssertions = replica,
              session_id: str | None = None) -> str:
        return maker.make(method=method, session_id=session_id or request.session_id,
                          principal=alice, peer="ipv4:192.0.2.1:1", to=to,
                          digest=request_digest(request))

    hit = execute(session_id, "hits.append(1)")
    async with grpc.aio.insecure_channel(target(owner)) as raw:
        # Made right, it runs (so what follows fails for what was changed, nothing else).
        accepted = vouch(hit)
        events = await send(raw, hit, [(FORWARDED_HEADER, accepted)])
        assert events[-1].result.outcome == events_pb2.OUTCOME_OK
        other_request = execute(session_id, "hits.append('other')")
        late = FleetAssertions(FLEET_SECRET, lambda: "127.0.0.1:1",
                               clock=lambda: time.time() - 60)
        early = FleetAssertions(FLEET_SECRET, lambda: "127.0.0.1:1",
                                clock=lambda: time.time() + 60)
        wrong = FleetAssertions("another-fleet-secret-of-enough-length!", lambda: "x:1")
        attempts: dict[str, tuple[tool_service_pb2.ExecuteRequest, list[tuple[str, str]]]] = {
            "replayed": (hit, [(FORWARDED_HEADER, accepted)]),
            "principal changed": (hit, [(FORWARDED_HEADER,
                                         edited(vouch(hit), principal="bob"))]),
            "roles changed": (hit, [(FORWARDED_HEADER,
                                     edited(vouch(hit), roles=["admin", "approver"]))]),
            "session changed": (hit, [(FORWARDED_HEADER,
                                       edited(vouch(hit), session="another"))]),
            "for another session": (hit, [(FORWARDED_HEADER,
                                           vouch(hit, session_id="another"))]),
            "another request": (other_request, [(FORWARDED_HEADER, vouch(hit))]),
            "another method": (hit, [(FORWARDED_HEADER,
                                      vouch(hit, method=f"/{SERVICE_NAME}/StartRun"))]),
            "another replica": (hit, [(FORWARDED_HEADER, vouch(hit, to=target(other)))]),
            "expired": (hit, [(FORWARDED_HEADER, vouch(hit, maker=late))]),
            "from the future": (hit, [(FORWARDED_HEADER, vouch(hit, maker=early))]),
            "wrong secret": (hit, [(FORWARDED_HEADER, vouch(hit, maker=wrong))]),
            "no signature": (hit, [(FORWARDED_HEADER, vouch(hit).rpartition(".")[0])]),
            "empty": (hit, [(FORWARDED_HEADER, "")]),
            "garbage": (hit, [(FORWARDED_HEADER, "v1.%%%.$$$")]),
            "oversized": (hit, [(FORWARDED_HEADER, "v1." + "A" * 6000 + ".AAAA")]),
            "twice": (hit, [(FORWARDED_HEADER, vouch(hit)), (FORWARDED_HEADER, vouch(hit))]),
            "with a token too": (hit, [(FORWARDED_HEADER, vouch(hit)),
                                       ("authorization", f"Bearer {fleet.keys['alice']}")]),
        }
        for name, (request, metadata) in attempts.items():
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await send(raw, request, metadata)
            assert refused(caught.value), name
        # Only the session methods a replica forwards take an assertion.
        for call in (stub_of(raw).ListSessions(tool_service_pb2.ListSessionsRequest(),
                                               metadata=[(FORWARDED_HEADER, vouch(hit))]),
                     stub_of(raw).CreateSession(
                         tool_service_pb2.CreateSessionRequest(kind="python"),
                         metadata=[(FORWARDED_HEADER, vouch(hit))])):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call
            assert refused(caught.value)
    async with key_channel(target(owner), fleet.keys["alice"]) as on_owner:
        assert await value_of(stub_of(on_owner), session_id, "hits") == [1]
        assert [s.session_id for s in (await stub_of(on_owner).ListSessions(
            tool_service_pb2.ListSessionsRequest())).sessions] == [session_id]
    records = await records_of(owner)
    refusals = [r for r in records if r.outcome == "unauthenticated"]
    assert len(refusals) == len(attempts) + 2
    assert all(r.principal == "" for r in refusals)


async def test_a_client_sending_the_forwarded_header_is_refused(fleet) -> None:
    owner = await fleet.replica()
    without_secret = await fleet.replica(fleet_secret=None)
    alice = fleet.keys["alice"]
    async with key_channel(target(owner), alice) as on_owner:
        session_id = await create(stub_of(on_owner))
        await python(stub_of(on_owner), session_id, "n = 0")
    request = execute(session_id, "n += 1")
    # A valid assertion, to a replica without the secret: it accepts no forwarded call.
    vouched = FleetAssertions(FLEET_SECRET, lambda: "127.0.0.1:1").make(
        method=EXECUTE, session_id=session_id, peer="", to=target(without_secret),
        principal=Principal(id="alice", roles=frozenset({"admin"}), method="api_key"),
        digest=request_digest(request))
    for server in (owner, without_secret):
        async with key_channel(target(server), alice) as channel:
            # A client with good credentials of its own, claiming to be a replica.
            for value in ("1", vouched):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await send(channel, request, [(FORWARDED_HEADER, value)])
                assert refused(caught.value)
        async with grpc.aio.insecure_channel(target(server)) as raw:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await send(raw, request, [(FORWARDED_HEADER, vouched)])
            assert refused(caught.value)
    async with key_channel(target(owner), alice) as on_owner:
        assert await value_of(stub_of(on_owner), session_id, "n") == 0


class FakeReplica(grpc.GenericRpcHandler):
    """A gRPC server the fleet's Redis was made to name as a session's owner: it keeps what
    it receives and answers UNAVAILABLE."""

    def __init__(self) -> None:
        self.received: list[tuple[str, dict[str, Any], bytes]] = []

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method = details.method

        async def keep(request: bytes, context: grpc.aio.ServicerContext) -> Any:
            self.received.append((method, dict(context.invocation_metadata() or ()),
                                  request))
            await context.abort(grpc.StatusCode.UNAVAILABLE, "a fake replica")

        if method.endswith("/Execute"):
            async def stream(request: bytes, context: grpc.aio.ServicerContext
                             ) -> AsyncIterator[bytes]:
                await keep(request, context)
                yield b""

            return grpc.unary_stream_rpc_method_handler(stream)
        return grpc.unary_unary_rpc_method_handler(keep)


async def test_a_redirected_owner_receives_nothing_it_can_use(fleet) -> None:
    owner = await fleet.replica()
    other = await fleet.replica()
    fake = FakeReplica()
    impostor = grpc.aio.server()
    impostor.add_generic_rpc_handlers((fake,))
    fake_port = impostor.add_insecure_port("127.0.0.1:0")
    await impostor.start()
    try:
        alice = fleet.keys["alice"]
        async with key_channel(target(owner), alice) as on_owner:
            session_id = await create(stub_of(on_owner))
            await python(stub_of(on_owner), session_id, "n = 0")
        # Whoever can write the fleet's Redis points the session at the impostor.
        directory = other.service.sessions.directory
        assert directory is not None
        await directory._redis.set(directory._record_key(session_id), json.dumps(
            {"replica": f"127.0.0.1:{fake_port}", "principal": "alice"}))
        async with key_channel(target(other), alice) as on_other:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await python(stub_of(on_other), session_id, "n += 1")
            assert reason(caught.value) == "SESSION_LOST"
        [(method, metadata, data)] = fake.received
        assert method == EXECUTE
        assert "authorization" not in metadata
        assert all(alice not in str(value) for value in metadata.values())
        # What it got opens nothing: not on the owner, not on the other replica, not for
        # this request nor another.
        captured = [(FORWARDED_HEADER, metadata[FORWARDED_HEADER])]
        request = tool_service_pb2.ExecuteRequest.FromString(data)
        for replica in (owner, other):
            async with grpc.aio.insecure_channel(target(replica)) as raw:
                for sent in (request, execute(session_id, "n += 100")):
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await send(raw, sent, captured)
                    assert refused(caught.value)
        async with key_channel(target(owner), alice) as on_owner:
            assert await value_of(stub_of(on_owner), session_id, "n") == 0
    finally:
        await impostor.stop(None)
