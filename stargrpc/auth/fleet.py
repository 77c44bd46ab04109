"""Replica-to-replica assertions: a call one replica forwards to another, vouched for.

A call naming a session another replica holds is forwarded to that replica
(:mod:`stargrpc.sessions.forwarding`). The caller's credentials stay where they were
presented: the forwarding replica authenticates the caller itself, then sends the owner an
*assertion* in the ``stargrpc-session-forwarded`` metadata — who the caller is, for which
call — signed with a key derived from ``fleet_secret``, which every replica shares::

    v1.<base64url(payload)>.<base64url(HMAC-SHA256(key, "v1." + base64url(payload)))>

The payload is compact JSON with sorted keys: the version, the RPC method, the session id
(empty for ListSessions, which names none: the caller's sessions the owner holds are asked for),
the principal (id, roles, how it authenticated), the caller's peer, the replica that
forwarded it (``from``) and the one it is for (``to``), when it was made (ms), a random
nonce, and the SHA-256 of the request message (deterministic serialisation). The owner
checks the signature first (constant time), then that the assertion is for *this* replica,
*this* method, *this* session and *this* request, made within :data:`WINDOW_SECONDS` (and at
most :data:`SKEW_SECONDS` ahead of its clock), with a nonce it has not accepted before.

So an assertion is worth one call: seen by anyone else — a replica the fleet's Redis was
made to name, an observer of a plaintext network — it cannot run any other request, on any
other replica or session, nor the same one twice or later. The nonces are remembered in the
process that accepted them: only the process holding the session can run a call for it, so
a replay that reaches another process (``--workers``) runs nothing either. A forwarded
ListSessions replayed to another process of the same replica within the window would list
that process's sessions of the caller: their ids and state, never a way in (an id alone
runs nothing; a call in a session needs its principal's credentials, or an assertion bound
to that session). TLS between replicas closes that too.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import Message

from stargrpc.contract import SERVICE_NAME
from stargrpc.errors import CredentialsRejected
from stargrpc.principal import Principal

#: Metadata holding the assertion; its presence marks a call one replica forwarded.
FORWARDED_HEADER = "stargrpc-session-forwarded"
#: The methods a replica forwards, and so the only ones an assertion is accepted for.
FORWARDED_METHODS = frozenset(f"/{SERVICE_NAME}/{name}"
                              for name in ("Execute", "StartRun", "CloseSession",
                                           "ListSessions"))
#: The forwarded methods whose request names no session: their assertion binds the empty
#: session id (ListSessions asks the replicas holding the caller's sessions for them).
UNBOUND_METHODS = frozenset({f"/{SERVICE_NAME}/ListSessions"})
#: How long an assertion is accepted after it was made.
WINDOW_SECONDS = 30.0
#: How far ahead of the receiving replica's clock an assertion's time may be.
SKEW_SECONDS = 5.0
#: The longest assertion sent or accepted (gRPC's default limit on a call's metadata is
#: 8 KiB, all of it).
MAX_ASSERTION_CHARS = 4096
#: Nonces remembered at once; a replica past it refuses forwarded calls until some expire
#: (evicting a live nonce would let its assertion be replayed).
MAX_REMEMBERED_NONCES = 100_000

_VERSION = "v1"
_KEY_LABEL = b"stargrpc session forwarding v1"
_FIELDS = frozenset({"v", "method", "session", "principal", "roles", "auth", "peer", "from",
                     "to", "iat", "nonce", "digest"})
_MAX_ROLES = 256


@dataclass(frozen=True)
class Forwarded:
    """A forwarded call, as its verified assertion describes it.

    Attributes:
        principal: The caller, as the forwarding replica authenticated it.
        replica: The address of the replica that forwarded the call.
        peer: The caller's address, as the forwarding replica saw it.
    """

    principal: Principal
    replica: str
    peer: str


def request_digest(request: Message) -> str:
    """The SHA-256 (hex) of ``request``'s deterministic serialisation."""
    return hashlib.sha256(request.SerializeToString(deterministic=True)).hexdigest()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    """base64url without padding, strictly (any other character is an error).

    Raises:
        ValueError: Not that (``binascii.Error`` is one).
    """
    if not text.isascii():
        raise ValueError("not base64url")
    return base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_", validate=True)


class FleetAssertions:
    """Makes the assertions of calls this replica forwards, and checks those it receives.

    Attributes:
        replica: This replica's address as the others reach it (called when needed: it is
            known once the port is bound).
    """

    replica: Callable[[], str]
    _key: bytes
    _clock: Callable[[], float]
    _monotonic: Callable[[], float]
    _seen: dict[str, tuple[float, float]]
    _forgotten_up_to: float

    def __init__(self, secret: str, replica: Callable[[], str], *,
                 clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        # A key of its own: the fleet secret could one day sign something else too, and an
        # assertion must never verify as that (or the reverse).
        self._key = hmac.new(secret.encode("utf-8"), _KEY_LABEL, hashlib.sha256).digest()
        self.replica = replica
        self._clock = clock
        self._monotonic = monotonic
        self._seen = {}
        # The latest assertion time among the nonces forgotten: none at or before it is
        # taken again, whatever the wall clock does (stepped back, it would otherwise let a
        # forgotten nonce's assertion back into the window).
        self._forgotten_up_to = 0.0

    def _mac(self, signed: bytes) -> bytes:
        return hmac.new(self._key, signed, hashlib.sha256).digest()

    def make(self, *, method: str, session_id: str, principal: Principal, peer: str,
             to: str, digest: str) -> str:
        """The assertion of one forwarded call (the value of :data:`FORWARDED_HEADER`).

        Args:
            method: The full method name the call is forwarded as.
            session_id: The session the request names.
            principal: The caller, authenticated here.
            peer: The caller's address as this replica sees it.
            to: The address of the replica the call goes to.
            digest: :func:`request_digest` of the request sent.

        Raises:
            ValueError: The assertion would be longer than :data:`MAX_ASSERTION_CHARS`
                (a principal with very many roles).
        """
        payload = {
            "v": 1, "method": method, "session": session_id, "principal": principal.id,
            "roles": sorted(principal.roles), "auth": principal.method, "peer": peer[:200],
            "from": self.replica(), "to": to, "iat": int(self._clock() * 1000),
            "nonce": _b64(secrets.token_bytes(16)), "digest": digest,
        }
        encoded = _b64(json.dumps(payload, sort_keys=True, separators=(",", ":"),
                                  ensure_ascii=True).encode("ascii"))
        signed = f"{_VERSION}.{encoded}"
        assertion = f"{signed}.{_b64(self._mac(signed.encode('ascii')))}"
        if len(assertion) > MAX_ASSERTION_CHARS:
            raise ValueError("the caller's principal is too large to vouch for")
        return assertion

    def verify(self, values: Iterable[str | bytes], *, method: str, request: Any
               ) -> Forwarded:
        """The forwarded call the assertion in ``values`` (every value the call's metadata
        holds under :data:`FORWARDED_HEADER`) describes, when it checks out for ``method``
        and ``request``; its nonce is then spent.

        Raises:
            CredentialsRejected: Anything amiss; ``cause`` (``forwarded_…``) says what, for
                the log and the metrics only.
        """
        given = list(values)
        if len(given) != 1 or not isinstance(given[0], str):
            raise CredentialsRejected("forwarded_malformed")
        assertion = given[0]
        if len(assertion) > MAX_ASSERTION_CHARS or assertion.count(".") != 2:
            raise CredentialsRejected("forwarded_malformed")
        version, encoded, signature = assertion.split(".")
        if version != _VERSION:
            raise CredentialsRejected("forwarded_version")
        try:
            mac = _unb64(signature)
        except ValueError:
            raise CredentialsRejected("forwarded_malformed") from None
        expected = self._mac(f"{version}.{encoded}".encode("ascii", errors="replace"))
        if not hmac.compare_digest(mac, expected):
            raise CredentialsRejected("forwarded_bad_signature")
        # Signed by a replica of the fleet from here on; still checked field by field.
        payload = _payload(encoded)
        now = self._clock()
        made = payload["iat"] / 1000
        if made < now - WINDOW_SECONDS or made > now + SKEW_SECONDS:
            raise CredentialsRejected("forwarded_expired")
        if payload["to"] != self.replica():
            raise CredentialsRejected("forwarded_other_replica")
        if payload["method"] != method or method not in FORWARDED_METHODS:
            raise CredentialsRejected("forwarded_other_method")
        if not isinstance(request, Message):
            raise CredentialsRejected("forwarded_other_request")
        # A request that names no session (ListSessions) binds the empty one.
        if payload["session"] != getattr(request, "session_id", ""):
            raise CredentialsRejected("forwarded_other_session")
        if not hmac.compare_digest(payload["digest"], request_digest(request)):
            raise CredentialsRejected("forwarded_other_request")
        self._spend(payload["nonce"], made)
        principal = Principal(id=payload["principal"], roles=frozenset(payload["roles"]),
                              method=payload["auth"])
        return Forwarded(principal, payload["from"], payload["peer"])

    def _spend(self, nonce: str, made: float) -> None:
        """Remembers ``nonce`` (of an assertion made at ``made``, wall clock) for as long as
        its assertion could be accepted.

        Raises:
            CredentialsRejected: Seen before, made no later than a nonce already forgotten,
                or too many remembered already.
        """
        now = self._monotonic()
        seen = self._seen
        # Insertion order is expiry order (one lifetime for all, a monotonic clock).
        while seen:
            oldest = next(iter(seen))
            expires, oldest_made = seen[oldest]
            if expires > now:
                break
            del seen[oldest]
            self._forgotten_up_to = max(self._forgotten_up_to, oldest_made)
        if made <= self._forgotten_up_to:
            raise CredentialsRejected("forwarded_expired")
        if nonce in seen:
            raise CredentialsRejected("forwarded_replayed")
        if len(seen) >= MAX_REMEMBERED_NONCES:
            raise CredentialsRejected("forwarded_replay_cache_full")
        # Long enough for any clock this assertion's time was accepted under.
        seen[nonce] = (now + WINDOW_SECONDS + SKEW_SECONDS, made)


def _payload(encoded: str) -> dict[str, Any]:
    """The payload of a signed assertion, every field of its exact type.

    Raises:
        CredentialsRejected: Not that (cause ``forwarded_malformed``).
    """
    try:
        payload = json.loads(_unb64(encoded), object_pairs_hook=_no_duplicates)
    except (ValueError, RecursionError):
        raise CredentialsRejected("forwarded_malformed") from None
    if not isinstance(payload, dict) or payload.keys() != _FIELDS or payload["v"] != 1:
        raise CredentialsRejected("forwarded_malformed")
    texts = ("method", "session", "principal", "auth", "peer", "from", "to", "nonce",
             "digest")
    roles = payload["roles"]
    if (not all(isinstance(payload[name], str) for name in texts)
            or not payload["principal"]
            or (not payload["session"] and payload["method"] not in UNBOUND_METHODS)
            or type(payload["iat"]) is not int or not 0 <= payload["iat"] < 10**15
            or not isinstance(roles, list) or len(roles) > _MAX_ROLES
            or not all(isinstance(role, str) for role in roles)):
        raise CredentialsRejected("forwarded_malformed")
    return payload


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        raise ValueError("a key twice")
    return result
