"""The MCP endpoint's door: who is calling, and which sessions are theirs.

The SDK's session manager (``mcp.server.streamable_http_manager``) keeps the handshake-era
sessions. It binds each session to the identity in the ``scope["user"]`` of the request
that opened it (an ``AuthenticatedUser``, as its own bearer middleware makes) and answers a
request of any other identity for that session exactly as it answers an unknown session
(404), whatever the method: a POST (a ``notifications/cancelled`` included), the GET of the
standalone stream, a DELETE. :class:`SessionGuard` puts that identity there, before the
manager sees the request:

- the request's credentials go through the server's own
  :class:`~stargrpc.auth.Authenticator` (the one gRPC calls go through); without valid ones
  the answer is ``401`` and nothing is created, no session above all;
- the principal, so authenticated, is the session's owner;
- a principal holds at most ``mcp_max_sessions_per_principal`` sessions: one more is
  refused (``429``, JSON-RPC error :data:`~stargrpc.mcp.mapping.TOO_MANY_SESSIONS`), never
  made room for by ending one of theirs — that one may be another of their agents' working
  session, and ending sessions from outside the manager would take its private internals.
  A session ends with its client's DELETE, or once idle for ``mcp_session_idle_seconds``.

:class:`Sessions` counts each principal's sessions from what the door sees pass: a
session is opened by a request without ``Mcp-Session-Id`` answered below 400 with one; it
ends when a DELETE of its owner is answered below 400, when the manager answers 404 for it
(it is gone), or once it has had no request in flight for the idle timeout the manager is
given too (the door sees a request end just after the manager does, so it never counts a
session gone before the manager has ended it).

2026-07-28 requests have no sessions; they are authenticated like the rest.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import structlog
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from mcp.server.streamable_http import MCP_SESSION_ID_HEADER
from mcp.shared.inbound import MCP_PROTOCOL_VERSION_HEADER
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stargrpc import metrics
from stargrpc.audit.record import AuditRecord, utc_now
from stargrpc.audit.writer import AuditWriter
from stargrpc.auth.authenticator import Authenticator
from stargrpc.errors import CredentialsRejected
from stargrpc.forwarded import peer_of
from stargrpc.gateway.app import call_metadata
from stargrpc.ids import new_id
from stargrpc.mcp.mapping import TOO_MANY_SESSIONS, UNAUTHENTICATED
from stargrpc.principal import Principal

log = structlog.get_logger("stargrpc.mcp")

#: The ``method`` of the audit record of a request the endpoint refused before it reached the
#: gRPC server (followed by the HTTP method: ``/stargrpc.mcp/Endpoint/POST``).
MCP_AUDIT_METHOD = "/stargrpc.mcp/Endpoint"

_SESSION_HEADER = MCP_SESSION_ID_HEADER.lower().encode("latin-1")


@dataclass
class _Session:
    owner: str
    in_flight: int = 0
    idle_since: float = 0.0


class Sessions:
    """The open MCP sessions of one endpoint, by the principal who opened each.

    Attributes:
        per_principal: The most sessions one principal may hold.
        idle_seconds: How long a session lasts without a request in flight.
    """

    per_principal: int
    idle_seconds: float
    _clock: Callable[[], float]
    _open: dict[str, _Session]
    _opening: Counter[str]

    def __init__(self, per_principal: int, idle_seconds: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.per_principal = per_principal
        self.idle_seconds = idle_seconds
        self._clock = clock
        self._open = {}
        self._opening = Counter()

    def count(self, principal: str | None = None) -> int:
        """How many sessions are open (those of ``principal``, when given)."""
        self._expire()
        return sum(1 for session in self._open.values()
                   if principal is None or session.owner == principal)

    def owner(self, session_id: str) -> str | None:
        """The principal who opened ``session_id``; None when it is unknown or over."""
        self._expire()
        session = self._open.get(session_id)
        return session.owner if session is not None else None

    def admit(self, principal: str) -> bool:
        """Whether ``principal`` may open one more session; if so, its place is kept until
        :meth:`opened` or :meth:`abandoned`."""
        if self.count(principal) + self._opening[principal] >= self.per_principal:
            return False
        self._opening[principal] += 1
        return True

    def opened(self, session_id: str, principal: str) -> None:
        """The admitted opening of ``principal`` made ``session_id`` (its request still in
        flight)."""
        self._release(principal)
        self._open[session_id] = _Session(principal, in_flight=1)

    def abandoned(self, principal: str) -> None:
        """The admitted opening of ``principal`` made no session."""
        self._release(principal)

    def begin(self, session_id: str) -> None:
        """A request of the session's owner is in flight."""
        session = self._open.get(session_id)
        if session is not None:
            session.in_flight += 1

    def end(self, session_id: str) -> None:
        """That request was answered; the idle clock starts when none is left."""
        session = self._open.get(session_id)
        if session is not None:
            session.in_flight -= 1
            session.idle_since = self._clock()

    def forget(self, session_id: str) -> None:
        """``session_id`` is over."""
        self._open.pop(session_id, None)

    def clear(self) -> None:
        """Every session is over (the endpoint stopped)."""
        self._open.clear()
        self._opening.clear()

    def _release(self, principal: str) -> None:
        self._opening[principal] -= 1
        if self._opening[principal] <= 0:
            del self._opening[principal]

    def _expire(self) -> None:
        now = self._clock()
        for session_id in [session_id for session_id, session in self._open.items()
                           if session.in_flight <= 0
                           and now - session.idle_since >= self.idle_seconds]:
            del self._open[session_id]


class SessionGuard:
    """ASGI middleware before the SDK's session manager: authenticates every request,
    names its principal the owner of what it opens, and caps the sessions of each
    principal (see the module's docstring)."""

    app: ASGIApp
    sessions: Sessions
    _authenticator: Authenticator
    _audit: AuditWriter | None

    def __init__(self, app: ASGIApp, authenticator: Authenticator, sessions: Sessions, *,
                 audit: AuditWriter | None = None) -> None:
        self.app = app
        self.sessions = sessions
        self._authenticator = authenticator
        self._audit = audit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        try:
            principal = self._authenticator.authenticate(call_metadata(request), {})
        except CredentialsRejected as error:
            metrics.AUTH_FAILURES.labels(error.cause).inc()
            peer = peer_of(request.client.host) if request.client else ""
            log.info("mcp_unauthenticated", cause=error.cause, method=request.method, peer=peer)
            self._record_refusal(request.method, peer, error)
            await _unauthenticated(send, missing=error.cause == "missing")
            return
        scope["user"] = _session_owner(principal)
        version = request.headers.get(MCP_PROTOCOL_VERSION_HEADER)
        if version is not None and version not in HANDSHAKE_PROTOCOL_VERSIONS:
            await self.app(scope, receive, send)  # 2026-07-28 and later: no sessions
            return
        session_id = request.headers.get(MCP_SESSION_ID_HEADER)
        if session_id is None:  # the manager opens a session for any such request
            await self._open(principal.id, scope, receive, send)
        elif self.sessions.owner(session_id) == principal.id:
            await self._in_session(session_id, scope, receive, send)
        else:  # unknown, over, or another principal's: the manager answers as for unknown
            await self.app(scope, receive, send)

    def _record_refusal(self, http_method: str, peer: str, error: CredentialsRejected) -> None:
        """The audit record of a request refused for its credentials: one record per call
        attempt, unauthenticated ones too, as for gRPC calls (the request's body is not
        read, so the record names the HTTP method, not the JSON-RPC one)."""
        if self._audit is None:
            return
        record = AuditRecord(id=new_id(), time=utc_now(),
                             method=f"{MCP_AUDIT_METHOD}/{http_method}", peer=peer,
                             outcome="unauthenticated", detail=f"UNAUTHENTICATED: {error.cause}")
        try:
            self._audit.submit(record)
        except RuntimeError:  # the writer is closed: the server is stopping
            log.error("audit_record_not_stored", reason="the audit writer is closed",
                      record=record.as_dict())

    async def _open(self, principal: str, scope: Scope, receive: Receive, send: Send) -> None:
        sessions = self.sessions
        if not sessions.admit(principal):
            log.info("mcp_sessions_refused", principal=principal,
                     limit=sessions.per_principal)
            await _error(send, 429, TOO_MANY_SESSIONS, (
                f"too many open MCP sessions: a principal holds at most "
                f"{sessions.per_principal} (mcp_max_sessions_per_principal); end one with "
                f"DELETE, or wait until one has been idle for {sessions.idle_seconds:g} s"))
            return
        opened: str | None = None

        async def watch(message: Message) -> None:
            nonlocal opened
            if message["type"] == "http.response.start" and message["status"] < 400:
                opened = _session_id(message)
                if opened is not None:  # counted before its client can use it
                    sessions.opened(opened, principal)
                    log.info("mcp_session_opened", principal=principal,
                             sessions=sessions.count(principal))
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            if opened is None:
                sessions.abandoned(principal)
            else:
                sessions.end(opened)

    async def _in_session(self, session_id: str, scope: Scope, receive: Receive,
                          send: Send) -> None:
        sessions = self.sessions
        ending = scope["method"] == "DELETE"

        async def watch(message: Message) -> None:
            if message["type"] == "http.response.start" and (
                    message["status"] == 404 or (ending and message["status"] < 400)):
                sessions.forget(session_id)  # before its client hears it is over
            await send(message)

        sessions.begin(session_id)
        try:
            await self.app(scope, receive, watch)
        finally:
            sessions.end(session_id)


def _session_owner(principal: Principal) -> AuthenticatedUser:
    """The principal as the SDK's session manager compares owners: by its id, the owner of
    runs too (the token itself is kept nowhere)."""
    return AuthenticatedUser(AccessToken(token="", client_id=principal.id,
                                         scopes=sorted(principal.roles)))


def _session_id(start: Message) -> str | None:
    for name, value in start.get("headers", ()):
        if name.lower() == _SESSION_HEADER:
            return bytes(value).decode("latin-1")
    return None


async def _unauthenticated(send: Send, *, missing: bool) -> None:
    """401 with ``WWW-Authenticate: Bearer``, so an MCP client knows to ask for a token; the
    same words whatever was wrong with the credentials given (the cause is logged)."""
    if missing:
        await _error(send, 401, UNAUTHENTICATED,
                     "missing credentials: send Authorization: Bearer <key or JWT>",
                     www_authenticate='Bearer realm="stargrpc"')
    else:
        await _error(send, 401, UNAUTHENTICATED, "missing or invalid credentials",
                     www_authenticate='Bearer realm="stargrpc", error="invalid_token"')


async def _error(send: Send, status: int, code: int, message: str,
                 www_authenticate: str | None = None) -> None:
    """A JSON-RPC error without a request id, answered with HTTP ``status``."""
    body = json.dumps({"jsonrpc": "2.0", "id": None,
                       "error": {"code": code, "message": message}}).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    if www_authenticate is not None:
        headers.append((b"www-authenticate", www_authenticate.encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
