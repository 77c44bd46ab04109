"""The door pass: a front end of this process already authenticated this call's credentials.

The MCP endpoint authenticates each HTTP request at its door (it must: a session is opened
for, and used by, one principal), then makes the request's gRPC calls on a loopback channel
with the same ``authorization``, so the auth interceptor would verify the same credential
again — for a JWT, a second signature check (RS256 about 80 µs, ES256 about 200 µs). A door
pass spares that second check, and only that:

- the door mints it with :meth:`DoorPasses.mint` for the principal it just authenticated: a
  random name (128 bits) for an entry kept in this process's memory, for one
  :class:`~stargrpc.auth.authenticator.Authenticator`, holding that principal, the very
  credential (the ``authorization`` value) it was minted for, and an expiry a few seconds
  ahead; nothing of it is written anywhere or sent anywhere but in the loopback call;
- the auth interceptor (:meth:`DoorPasses.principal`) takes the principal from a pass only
  when the pass names an entry of its own authenticator that has not expired, the call
  came from a loopback peer, and it carries that same credential.

So a pass is worth nothing without the credential it names, which on its own already
authenticates as the same principal: copying one, forging one, or sending one from another
host never changes who a call is. A pass that does not check out is ignored, and the call's
credentials are authenticated as ever (a call that carries none ends UNAUTHENTICATED). That
is also what happens to a pass that reaches a sibling worker of ``--workers`` (each worker
knows only its own): the worker simply authenticates the credential itself. Everything after
authentication — the audit record, permissions, the critic, lanes, approval — is the same
for a call that came with a pass.
"""

from __future__ import annotations

import hmac
import secrets
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from stargrpc.auth.authenticator import Authenticator
from stargrpc.principal import Principal

#: The metadata carrying a door pass.
DOOR_PASS_METADATA = "stargrpc-door-pass"

#: How long a pass is good for: the gRPC calls of one MCP request start within it; a later
#: one (a CancelRun long after its call began) authenticates its credentials itself.
PASS_SECONDS = 10.0

#: The most passes kept at once per authenticator (a pass lives PASS_SECONDS): past it the
#: oldest is forgotten, and its calls authenticate their credentials themselves.
MAX_PASSES = 100_000

_LOOPBACK_PEERS = ("ipv4:127.", "ipv6:[::1]", "ipv6:%5B::1%5D")


@dataclass(frozen=True)
class _Pass:
    principal: Principal
    authorization: str
    expires: float


@dataclass
class _Kept:
    """The passes of one authenticator, and their names in the order they were minted
    (hence of expiry)."""

    passes: dict[str, _Pass] = field(default_factory=dict)
    order: deque[str] = field(default_factory=deque)


_kept: weakref.WeakKeyDictionary[Authenticator, _Kept] = weakref.WeakKeyDictionary()


class DoorPasses:
    """Mints and checks the door passes of one authenticator (of the front ends and the
    gRPC server that share it, in this process)."""

    _kept: _Kept
    _clock: Callable[[], float]

    def __init__(self, authenticator: Authenticator, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        kept = _kept.get(authenticator)
        if kept is None:
            kept = _kept[authenticator] = _Kept()
        self._kept = kept
        self._clock = clock

    def mint(self, principal: Principal, authorization: str) -> str:
        """A pass for ``principal``, whom the credential ``authorization`` (the header's
        whole value) authenticated just now."""
        now = self._clock()
        kept = self._kept
        order, passes = kept.order, kept.passes
        while order and (len(order) >= MAX_PASSES or passes[order[0]].expires < now):
            del passes[order.popleft()]
        name = secrets.token_urlsafe(16)
        passes[name] = _Pass(principal, authorization, now + PASS_SECONDS)
        order.append(name)
        return name

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
        if len(passes) != 1 or len(authorizations) != 1 or not isinstance(passes[0], str) \
                or not isinstance(authorizations[0], str) \
                or not peer.startswith(_LOOPBACK_PEERS):
            return None
        kept = self._kept.passes.get(passes[0])
        if kept is None or kept.expires < self._clock() or not hmac.compare_digest(
                kept.authorization.encode(), authorizations[0].encode()):
            return None
        return kept.principal
