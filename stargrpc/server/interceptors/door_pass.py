"""The door pass: a front end of this process already authenticated this call's credentials.

The MCP endpoint authenticates each HTTP request at its door (it must: a session is opened
for, and used by, one principal), then makes the request's gRPC calls on a loopback channel
with the same ``authorization``, so the auth interceptor would verify the same credential
again — for a JWT, a second signature check (RS256 about 80 µs, ES256 about 200 µs). A door
pass spares that second check, and only that:

- the door mints it with :meth:`DoorPasses.mint` for the principal it just authenticated: an
  HMAC, under a key made at random in this process for one
  :class:`~stargrpc.auth.authenticator.Authenticator` (never written anywhere, never sent),
  of that principal, an expiry a few seconds ahead, and a digest of the credential
  (the ``authorization`` value) it was minted for;
- the auth interceptor (:meth:`DoorPasses.principal`) takes the principal from a pass only
  when the pass verifies under the key of its own authenticator, has not expired, came
  from a loopback peer, and the call carries the very credential the pass was minted for.

So a pass is worth nothing without the credential it names, which on its own already
authenticates as the same principal: copying one, forging one, or sending one from another
host never changes who a call is. A pass that does not check out is ignored, and the call's
credentials are authenticated as ever (a call that carries none ends UNAUTHENTICATED). That
is also what happens to a pass that reaches a sibling worker of ``--workers`` (each worker's
key is its own): the worker simply authenticates the credential itself. Everything after
authentication — the audit record, permissions, the critic, lanes, approval — is the same
for a call that came with a pass.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
import weakref
from collections.abc import Callable, Iterable

from stargrpc.auth.authenticator import Authenticator
from stargrpc.principal import Principal

#: The metadata carrying a door pass.
DOOR_PASS_METADATA = "stargrpc-door-pass"

#: How long a pass is good for: the gRPC calls of one MCP request start within it; a later
#: one (a CancelRun long after its call began) authenticates its credentials itself.
PASS_SECONDS = 10.0

#: The longest pass accepted (a principal's roles are few): anything longer is ignored.
MAX_PASS_CHARS = 4096

_LOOPBACK_PEERS = ("ipv4:127.", "ipv6:[::1]", "ipv6:%5B::1%5D")

_keys: weakref.WeakKeyDictionary[Authenticator, bytes] = weakref.WeakKeyDictionary()


def _credential_digest(authorization: str) -> bytes:
    return hashlib.sha256(authorization.encode()).digest()


class DoorPasses:
    """Mints and checks the door passes of one authenticator (of the front ends and the
    gRPC server that share it, in this process)."""

    _key: bytes
    _clock: Callable[[], float]

    def __init__(self, authenticator: Authenticator, *,
                 clock: Callable[[], float] = time.time) -> None:
        key = _keys.get(authenticator)
        if key is None:
            key = _keys[authenticator] = secrets.token_bytes(32)
        self._key = key
        self._clock = clock

    def _mac(self, body: str, authorization: str) -> str:
        message = body.encode() + b"\0" + _credential_digest(authorization)
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def mint(self, principal: Principal, authorization: str) -> str:
        """A pass for ``principal``, whom the credential ``authorization`` (the header's
        whole value) authenticated just now."""
        body = base64.urlsafe_b64encode(json.dumps(
            [principal.id, sorted(principal.roles), principal.method, principal.acting_for,
             round(self._clock() + PASS_SECONDS, 3)], separators=(",", ":")).encode()).decode()
        return f"{body}.{self._mac(body, authorization)}"

    def principal(self, metadata: Iterable[tuple[str, str | bytes]], peer: str
                  ) -> Principal | None:
        """The principal a call's pass names, when it checks out (see the module's
        docstring); None when the call has no pass, or one that does not check out."""
        passes: list[str | bytes] = []
        authorizations: list[str | bytes] = []
        for name, value in metadata:
            if name == DOOR_PASS_METADATA:
                passes.append(value)
            elif name == "authorization":
                authorizations.append(value)
        if (len(passes) != 1 or len(authorizations) != 1 or not peer.startswith(_LOOPBACK_PEERS)
                or not isinstance(passes[0], str) or not isinstance(authorizations[0], str)
                or len(passes[0]) > MAX_PASS_CHARS):
            return None
        body, _, mac = passes[0].partition(".")
        if not hmac.compare_digest(mac, self._mac(body, authorizations[0])):
            return None
        try:
            ident, roles, method, acting_for, expires = json.loads(
                base64.urlsafe_b64decode(body.encode()))
        except (ValueError, TypeError):  # only this process mints: not expected
            return None
        if not isinstance(expires, int | float) or expires < self._clock():
            return None
        return Principal(id=ident, roles=frozenset(roles), method=method,
                         acting_for=acting_for)
