"""Replica-to-replica assertions (stargrpc.auth.fleet): made by one replica, checked by the
replica holding the session; anything changed, late, early, twice, for another replica,
method, session or request, or not one at all, is refused with a cause of its own."""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from stargrpc.auth.fleet import (
    MAX_ASSERTION_CHARS,
    FleetAssertions,
    request_digest,
)
from stargrpc.contract import SERVICE_NAME
from stargrpc.errors import CredentialsRejected
from stargrpc.principal import Principal
from stargrpc.settings import Settings
from stargrpc.v1 import tool_service_pb2
from tests.auth.fleet_helpers import b64 as _b64
from tests.auth.fleet_helpers import edited, payload_of

SECRET = "a-fleet-secret-long-enough-to-be-a-real-one"
OWNER, SENDER = "10.0.0.1:50051", "10.0.0.2:50051"
EXECUTE = f"/{SERVICE_NAME}/Execute"
ALICE = Principal(id="alice", roles=frozenset({"admin", "ops"}), method="api_key")
REQUEST = tool_service_pb2.ExecuteRequest(tool_name="python", session_id="s-1",
                                          arguments_json='{"code": "x = 1"}')


def sender(secret: str = SECRET, clock: Any = time.time) -> FleetAssertions:
    return FleetAssertions(secret, lambda: SENDER, clock=clock)


def owner() -> FleetAssertions:
    return FleetAssertions(SECRET, lambda: OWNER)


def made(request: Any = REQUEST, *, method: str = EXECUTE,
         to: str = OWNER, principal: Principal = ALICE, **kwargs: Any) -> str:
    return sender(**kwargs).make(method=method,
                                 session_id=getattr(request, "session_id", ""),
                                 principal=principal, peer="ipv4:192.0.2.7:40000", to=to,
                                 digest=request_digest(request))


def signed(payload: bytes, secret: str = SECRET) -> str:
    """An assertion of ``payload`` (any bytes) signed as a replica with ``secret`` would."""
    key = hmac.new(secret.encode(), b"stargrpc session forwarding v1", hashlib.sha256).digest()
    text = f"v1.{_b64(payload)}"
    return f"{text}.{_b64(hmac.new(key, text.encode(), hashlib.sha256).digest())}"


def cause(values: list[Any], request: Any = REQUEST, method: str = EXECUTE,
          checker: FleetAssertions | None = None) -> str:
    with pytest.raises(CredentialsRejected) as refused:
        (checker or owner()).verify(values, method=method, request=request)
    return refused.value.cause


def test_an_assertion_names_the_caller_and_the_replica_that_sent_it() -> None:
    forwarded = owner().verify([made()], method=EXECUTE, request=REQUEST)
    assert forwarded.principal == ALICE
    assert forwarded.replica == SENDER
    assert forwarded.peer == "ipv4:192.0.2.7:40000"
    payload = payload_of(made())
    assert payload["roles"] == ["admin", "ops"] and payload["to"] == OWNER
    assert "authorization" not in json.dumps(payload)


def test_a_changed_field_breaks_the_signature() -> None:
    good = made()
    for change in ({"principal": "mallory"}, {"roles": ["admin", "ops", "root"]},
                   {"auth": "mtls"}, {"session": "s-2"}, {"digest": "0" * 64},
                   {"iat": payload_of(good)["iat"] + 1000}, {"nonce": "AAAA"},
                   {"to": "10.0.0.9:1"}, {"from": "10.0.0.9:1"}, {"peer": "ipv4:1.1.1.1"},
                   {"method": f"/{SERVICE_NAME}/CloseSession"}):
        assert cause([edited(good, **change)]) == "forwarded_bad_signature", change


def test_an_assertion_is_bound_to_its_request_session_method_and_replica() -> None:
    other_body = tool_service_pb2.ExecuteRequest(tool_name="python", session_id="s-1",
                                                 arguments_json='{"code": "import os"}')
    assert cause([made()], request=other_body) == "forwarded_other_request"
    other_session = tool_service_pb2.ExecuteRequest(tool_name="python", session_id="s-2",
                                                    arguments_json='{"code": "x = 1"}')
    assert cause([made()], request=other_session) == "forwarded_other_session"
    assert cause([made(method=f"/{SERVICE_NAME}/CloseSession")]) == "forwarded_other_method"
    creating = f"/{SERVICE_NAME}/CreateSession"
    assert cause([made(method=creating)], method=creating) == "forwarded_other_method"
    assert cause([made(to="10.0.0.9:50051")]) == "forwarded_other_replica"
    assert cause([made()], request=object()) == "forwarded_other_request"


def test_an_assertion_lives_thirty_seconds_and_a_little_skew() -> None:
    now = time.time()
    assert cause([made(clock=lambda: now - 31)]) == "forwarded_expired"
    assert cause([made(clock=lambda: now + 6)]) == "forwarded_expired"
    owner().verify([made(clock=lambda: now - 25)], method=EXECUTE, request=REQUEST)
    owner().verify([made(clock=lambda: now + 3)], method=EXECUTE, request=REQUEST)


def test_an_assertion_is_accepted_once() -> None:
    checker, assertion = owner(), made()
    checker.verify([assertion], method=EXECUTE, request=REQUEST)
    assert cause([assertion], checker=checker) == "forwarded_replayed"
    checker.verify([made()], method=EXECUTE, request=REQUEST)  # a new nonce: accepted


def test_remembered_nonces_are_forgotten_when_their_assertions_expire(monkeypatch) -> None:
    ticks = [1000.0]
    wall = [1_000_000.0]
    checker = FleetAssertions(SECRET, lambda: OWNER, clock=lambda: wall[0],
                              monotonic=lambda: ticks[0])
    monkeypatch.setattr("stargrpc.auth.fleet.MAX_REMEMBERED_NONCES", 2)
    checker.verify([made(clock=lambda: wall[0])], method=EXECUTE, request=REQUEST)
    checker.verify([made(clock=lambda: wall[0])], method=EXECUTE, request=REQUEST)
    # Full of live nonces: refused (forgetting one would let its assertion run again).
    assert cause([made(clock=lambda: wall[0])], checker=checker) == "forwarded_replay_cache_full"
    ticks[0] += 36  # past the window and the skew: both forgotten
    wall[0] += 36
    checker.verify([made(clock=lambda: wall[0])], method=EXECUTE, request=REQUEST)
    assert len(checker._seen) == 1


def test_a_forgotten_assertion_stays_refused_when_the_wall_clock_steps_back() -> None:
    """Nonces are forgotten by the monotonic clock, the window is judged by the wall clock:
    stepped back past the window, the wall clock would let a forgotten nonce's assertion
    in again — it does not."""
    wall, ticks = [1_000_000.0], [0.0]
    checker = FleetAssertions(SECRET, lambda: OWNER, clock=lambda: wall[0],
                              monotonic=lambda: ticks[0])
    replayed = made(clock=lambda: 1_000_000.0)
    checker.verify([replayed], method=EXECUTE, request=REQUEST)
    wall[0] += 40
    ticks[0] += 40
    checker.verify([made(clock=lambda: wall[0])], method=EXECUTE, request=REQUEST)
    assert len(checker._seen) == 1  # the first nonce forgotten

    wall[0] = 1_000_001.0  # stepped back 39 s: the first assertion is in its window again
    ticks[0] += 1

    assert cause([replayed], checker=checker) == "forwarded_expired"
    checker.verify([made(clock=lambda: wall[0])], method=EXECUTE, request=REQUEST)  # a new one


def test_the_wrong_secret_is_refused() -> None:
    assert cause([made(secret="another-fleet-secret-of-enough-length!!")]) == \
        "forwarded_bad_signature"
    assert cause([signed(json.dumps(payload_of(made())).encode(), "x" * 40)]) == \
        "forwarded_bad_signature"


@pytest.mark.parametrize(("values", "expected"), [
    ([], "forwarded_malformed"),
    (["", ], "forwarded_malformed"),
    (["1"], "forwarded_malformed"),
    (["v1.abc"], "forwarded_malformed"),
    (["v1.."], "forwarded_bad_signature"),
    (["v1.a.b.c"], "forwarded_malformed"),
    (["v2.abc.def"], "forwarded_version"),
    (["v1.!!!.@@@"], "forwarded_malformed"),
    (["v1.abc.ÿÿÿ"], "forwarded_malformed"),
    ([b"v1.abc.def"], "forwarded_malformed"),
    (["v1." + "A" * MAX_ASSERTION_CHARS + ".x"], "forwarded_malformed"),
], ids=["none", "empty", "no-dots", "two-parts", "empty-parts", "four-parts", "version",
        "garbage", "non-ascii", "binary", "oversized"])
def test_what_is_not_an_assertion_is_refused(values: list[Any], expected: str) -> None:
    assert cause(values) == expected


def test_two_assertions_are_refused() -> None:
    assert cause([made(), made()]) == "forwarded_malformed"


def test_a_signed_payload_must_have_every_field_of_its_type() -> None:
    good = payload_of(made())
    broken: list[bytes] = [
        b"not json", b"[]", b"null", b'{"v": 1}',
        json.dumps({**good, "v": 2}).encode(),
        json.dumps({**good, "extra": 1}).encode(),
        json.dumps({k: v for k, v in good.items() if k != "nonce"}).encode(),
        json.dumps({**good, "roles": "admin"}).encode(),
        json.dumps({**good, "roles": [1]}).encode(),
        json.dumps({**good, "roles": ["r"] * 300}).encode(),
        json.dumps({**good, "iat": str(good["iat"])}).encode(),
        json.dumps({**good, "iat": 10**30}).encode(),
        json.dumps({**good, "iat": True}).encode(),
        json.dumps({**good, "principal": ""}).encode(),
        json.dumps({**good, "principal": None}).encode(),
        json.dumps(good)[:-1].encode() + b', "principal": "mallory"}',  # a key twice
        b"[" * 100_000,
    ]
    for payload in broken:
        assert cause([signed(payload)]) in {"forwarded_malformed", "forwarded_expired"}, \
            payload[:80]
    # Well formed, re-signed with the secret: accepted (the cases above fail on shape).
    owner().verify([signed(json.dumps(good).encode())], method=EXECUTE, request=REQUEST)


def test_a_principal_too_large_to_vouch_for_is_refused_when_made() -> None:
    crowded = Principal(id="alice", roles=frozenset(f"role-{i}" for i in range(400)),
                        method="jwt")
    with pytest.raises(ValueError, match="too large"):
        made(principal=crowded)


def test_fleet_secret_is_a_secret_setting(tmp_path: Path) -> None:
    settings = Settings.load(fleet_secret=SECRET)
    assert settings.masked()["fleet_secret"] == "***"
    assert SECRET not in repr(settings) and SECRET not in str(settings.masked())
    secret_file = tmp_path / "fleet.secret"
    secret_file.write_text(SECRET + "\n")
    from_file = Settings.load(fleet_secret_file=secret_file)
    assert from_file.fleet_secret is not None
    assert from_file.fleet_secret.get_secret_value() == SECRET
    with pytest.raises(ValidationError, match="32 characters"):
        Settings.load(fleet_secret="short")
    with pytest.raises(ValidationError, match="not both"):
        Settings.load(fleet_secret=SECRET, fleet_secret_file=secret_file)
    with pytest.raises(ValidationError, match="together"):
        Settings.load(session_forward_cert_file=secret_file)


def test_fleet_secret_is_read_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("STARGRPC_FLEET_SECRET", SECRET)
    settings = Settings.load()
    assert settings.fleet_secret is not None
    assert settings.fleet_secret.get_secret_value() == SECRET
    from stargrpc.secret_env import secret_variables

    assert "STARGRPC_FLEET_SECRET" in secret_variables({"STARGRPC_FLEET_SECRET": SECRET})


LISTING = f"/{SERVICE_NAME}/ListSessions"


def test_a_listing_assertion_binds_no_session_and_nothing_else() -> None:
    listing = tool_service_pb2.ListSessionsRequest(with_files=True)
    # ListSessions names no session: its assertion binds the empty one, and is accepted.
    checker = owner()
    verified = checker.verify([made(listing, method=LISTING)], method=LISTING,
                              request=listing)
    assert verified.principal == ALICE
    # Not for another request, nor another method; nor a listing bound to a session.
    assert cause([made(listing, method=LISTING)], method=LISTING,
                 request=tool_service_pb2.ListSessionsRequest()) == "forwarded_other_request"
    assert cause([made(listing, method=LISTING)], request=listing) == "forwarded_other_method"
    assert cause([made(method=LISTING)], method=LISTING,
                 request=listing) == "forwarded_other_session"
    # Only a listing may bind the empty session: an Execute naming none is malformed.
    empty = tool_service_pb2.ExecuteRequest(tool_name="python", arguments_json="{}")
    assert cause([made(empty)], request=empty) == "forwarded_malformed"
