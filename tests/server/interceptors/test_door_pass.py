"""Door passes through a real server and a real channel: the pass of this process's door
spares the second check of the same credential, and nothing a caller can send with one —
forged, copied, expired, from another authenticator, beside another credential — makes it
anyone but who its own credentials say (or lets it in without any)."""

from __future__ import annotations

import secrets
from typing import Any

import grpc
import pytest

from stargrpc.auth import Authenticator
from stargrpc.principal import Principal
from stargrpc.server.interceptors import door_pass
from stargrpc.server.interceptors.auth import AuthInterceptor
from stargrpc.server.interceptors.door_pass import (
    DOOR_PASS_METADATA,
    PASS_SECONDS,
    DoorPasses,
)
from stargrpc.settings import Settings
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.auth_tools import auth_registry
from tests.conftest import AuthServer
from tests.helpers import count_authentications

TESTER = Principal(id="tester", roles=frozenset({"admin"}), method="api_key")


def _interceptor(auth: AuthServer) -> AuthInterceptor:
    return next(i for i in auth.server.interceptors if isinstance(i, AuthInterceptor))


async def _whoami(auth: AuthServer, metadata: list[tuple[str, str]]) -> str:
    """The whoami tool's answer to a call with exactly ``metadata``."""
    async with grpc.aio.insecure_channel(auth.target) as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        events = [reply.event async for reply in stub.Execute(
            tool_service_pb2.ExecuteRequest(tool_name="whoami"), metadata=metadata)]
    assert events[-1].result.outcome == events_pb2.OUTCOME_OK, events[-1]
    return events[-1].result.output


async def _refused(auth: AuthServer, metadata: list[tuple[str, str]]) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _whoami(auth, metadata)
    return caught.value.code()


async def test_a_pass_of_this_process_spares_the_second_check(
        make_auth_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    auth = await make_auth_server(auth_registry())
    checked = count_authentications(auth.server, monkeypatch)
    bearer = f"Bearer {auth.key}"
    door_pass = DoorPasses(_interceptor(auth).authenticator).mint(TESTER, bearer)

    answer = await _whoami(auth, [("authorization", bearer), (DOOR_PASS_METADATA, door_pass)])

    assert answer == "tester api_key admin"
    assert checked == []


async def test_a_pass_alone_lets_nobody_in(make_auth_server: Any) -> None:
    auth = await make_auth_server(auth_registry())
    door_pass = DoorPasses(_interceptor(auth).authenticator).mint(TESTER, f"Bearer {auth.key}")

    assert await _refused(auth, [(DOOR_PASS_METADATA, door_pass)]) is \
        grpc.StatusCode.UNAUTHENTICATED


async def test_a_pass_beside_another_credential_is_ignored(
        make_auth_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    auth = await make_auth_server(auth_registry())
    bob = auth.add_key("bob", "reader")
    door_pass = DoorPasses(_interceptor(auth).authenticator).mint(TESTER, f"Bearer {auth.key}")
    checked = count_authentications(auth.server, monkeypatch)

    answer = await _whoami(auth, [("authorization", f"Bearer {bob}"),
                                  (DOOR_PASS_METADATA, door_pass)])

    assert answer == "bob api_key reader"  # bob's own credential, checked
    assert checked == [1]
    assert await _refused(auth, [("authorization", "Bearer sgk_made_up"),
                                 (DOOR_PASS_METADATA, door_pass)]) is \
        grpc.StatusCode.UNAUTHENTICATED


async def test_a_pass_of_another_authenticator_is_ignored(
        make_auth_server: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    auth = await make_auth_server(auth_registry())
    # Another authenticator of the same keys: another server, or another worker's.
    elsewhere = Authenticator(Settings(insecure_no_auth=False,
                                       keys_file=_interceptor(auth).authenticator.keys.path))
    bob = auth.add_key("bob", "reader")
    forged = DoorPasses(elsewhere).mint(TESTER, f"Bearer {bob}")
    checked = count_authentications(auth.server, monkeypatch)

    answer = await _whoami(auth, [("authorization", f"Bearer {bob}"),
                                  (DOOR_PASS_METADATA, forged)])

    assert answer == "bob api_key reader"
    assert checked == [1]
    assert await _refused(auth, [(DOOR_PASS_METADATA, forged)]) is \
        grpc.StatusCode.UNAUTHENTICATED


async def test_an_expired_pass_is_ignored(make_auth_server: Any,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    auth = await make_auth_server(auth_registry())
    bearer = f"Bearer {auth.key}"
    authenticator = _interceptor(auth).authenticator
    stale = DoorPasses(authenticator, clock=lambda: 0.0).mint(TESTER, bearer)
    checked = count_authentications(auth.server, monkeypatch)

    assert await _whoami(auth, [("authorization", bearer),
                                (DOOR_PASS_METADATA, stale)]) == "tester api_key admin"
    assert checked == [1]
    assert PASS_SECONDS < 60  # a pass outlives no more than the calls of one request


async def test_hostile_passes_are_ignored_and_never_let_anyone_in(
        make_auth_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    auth = await make_auth_server(auth_registry())
    bob = auth.add_key("bob", "reader")
    bearer = f"Bearer {bob}"
    passes = DoorPasses(_interceptor(auth).authenticator)
    genuine = passes.mint(Principal(id="bob", roles=frozenset({"reader"}), method="api_key"),
                          bearer)
    admins = passes.mint(TESTER, f"Bearer {auth.key}")
    hostile = {
        "empty": "",
        "made up": secrets.token_urlsafe(16),
        "a genuine one, cut": genuine[:-1],
        "a genuine one, lengthened": genuine + "A",
        "two genuine ones": f"{genuine},{admins}",
        "oversized": "A" * 8192,
    }
    checked = count_authentications(auth.server, monkeypatch)

    for name, value in hostile.items():
        metadata = [(DOOR_PASS_METADATA, value)]
        assert await _refused(auth, metadata) is grpc.StatusCode.UNAUTHENTICATED, name
        assert await _whoami(auth, [("authorization", bearer), *metadata]) == \
            "bob api_key reader", name
    # Two passes, even two genuine ones, are not what a door sends.
    assert await _refused(auth, [(DOOR_PASS_METADATA, genuine)] * 2) is \
        grpc.StatusCode.UNAUTHENTICATED
    assert len(checked) == 2 * len(hostile) + 1


async def test_without_authentication_a_pass_changes_nothing(make_server: Any) -> None:
    server = await make_server(auth_registry())
    auth = AuthServer(server, "", None)  # type: ignore[arg-type]
    door_pass = DoorPasses(_interceptor(auth).authenticator).mint(TESTER, "Bearer x")

    assert await _whoami(auth, [(DOOR_PASS_METADATA, door_pass)]) == "local none *"


def test_a_pass_counts_only_from_a_loopback_peer_and_only_while_kept(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setattr(door_pass, "MAX_PASSES", 3)
    passes = DoorPasses(Authenticator(Settings(insecure_no_auth=False,
                                               keys_file=tmp_path / "keys.json")))
    bearer = "Bearer sgk_anything"
    first, *later = [passes.mint(TESTER, bearer) for _ in range(4)]

    def named(value: str, peer: str = "ipv4:127.0.0.1:40000") -> Principal | None:
        return passes.principal([("authorization", bearer), (DOOR_PASS_METADATA, value)], peer)

    assert [named(value) for value in later] == [TESTER] * 3
    assert named(first) is None  # the oldest, forgotten to keep at most MAX_PASSES
    assert named(later[0], "ipv6:[::1]:40000") == TESTER
    assert named(later[0], "ipv4:10.1.2.3:40000") is None
    assert named(later[0], "ipv6:[fe80::1]:40000") is None
    assert named(later[0], "unix:/tmp/socket") is None
