"""The authentication interceptor: every call gets a principal or ends UNAUTHENTICATED.

It runs a check first inside every call, of every method (all four call shapes, and methods
that do not exist, so probing for them needs credentials too):
it reads the ``authorization`` metadata and the TLS peer, sets
:data:`stargrpc.principal.current_principal` (and binds ``principal`` for the logs), and
fills the open :class:`~stargrpc.runs.call_record.CallRecord`. Refusals are UNAUTHENTICATED with the
same generic message whatever went wrong; the cause goes to the log and the
``tool_executor_auth_failures`` metric only. Health checks and reflection are open by
default (``auth_open_health``, ``auth_open_reflection``). Which tools a principal may run
is decided later, by :mod:`stargrpc.runs.permissions`.

A call carrying ``stargrpc-session-forwarded`` is a call another replica of the fleet
forwarded here (:mod:`stargrpc.sessions.forwarding`), and it takes the other path, the only
one it may take: its principal is the one the signed assertion in that header names
(:mod:`stargrpc.auth.fleet`), and only for the session methods a replica forwards, only on a
replica with ``fleet_secret`` (:attr:`AuthInterceptor.fleet`), only without credentials of
its own. Anything else carrying the header is refused UNAUTHENTICATED like any bad
credential. The call's audit record names the replica that forwarded it.
"""

from __future__ import annotations

from typing import Any

import grpc
import structlog

from stargrpc import metrics
from stargrpc.auth.authenticator import LOCAL, Authenticator
from stargrpc.auth.fleet import FORWARDED_HEADER, FORWARDED_METHODS, FleetAssertions
from stargrpc.errors import CredentialsRejected
from stargrpc.principal import Principal, current_principal
from stargrpc.runs.call_record import CallRecord, current_call
from stargrpc.server.interceptors.composed import ComposedInterceptor
from stargrpc.settings import Settings

log = structlog.get_logger("stargrpc.auth")

_HEALTH = frozenset({"grpc.health.v1.Health"})
_REFLECTION = frozenset({"grpc.reflection.v1alpha.ServerReflection",
                         "grpc.reflection.v1.ServerReflection"})
_LOOPBACK = ("127.", "::1", "[::1]", "localhost")


class AuthInterceptor(ComposedInterceptor):
    """Authenticates every call before its handler runs: the composed interceptor
    (:mod:`stargrpc.server.interceptors.composed`) with only its auth stage, which is this
    object.

    Attributes:
        fleet: Checks the assertions of calls other replicas forward here; None (no
            ``fleet_secret``, or no fleet) refuses every such call.
    """

    fleet: FleetAssertions | None

    def __init__(self, settings: Settings, *, authenticator: Authenticator | None = None
                 ) -> None:
        """Builds the credential checks the settings configure.

        Raises:
            AuthConfigError: A JWT key is unusable.
            OSError: A JWT key file cannot be read.
        """
        self._settings = settings
        self._authenticator = (authenticator if authenticator is not None
                               else Authenticator(settings))
        open_services: set[str] = set()
        if settings.auth_open_health:
            open_services |= _HEALTH
        if settings.auth_open_reflection:
            open_services |= _REFLECTION
        self._open_services = frozenset(open_services)
        self.fleet = None  # the server sets it when it joins a fleet with fleet_secret
        super().__init__(auth=self)

    @property
    def authenticator(self) -> Authenticator:
        """What makes a principal of a call's credentials (the MCP endpoint's too)."""
        return self._authenticator

    async def start(self) -> None:
        """Says loudly when authentication is off; reads the keys file once, so a broken
        one stops start-up instead of refusing every call."""
        settings = self._settings
        if settings.insecure_no_auth:
            exposed = not settings.host.startswith(_LOOPBACK)
            log.warning(
                "AUTHENTICATION IS OFF (--insecure-no-auth): every caller is the local "
                "principal and may run every tool, privileged ones included. For local "
                "experiments only." + (" The server listens beyond loopback!" if exposed
                                       else ""),
                host=settings.host)
            return
        keys = self._authenticator.keys.records()
        log.info("authentication", keys_file=str(self._authenticator.keys.path),
                 api_keys=sum(not k.revoked for k in keys),
                 jwt=self._authenticator.jwt is not None,
                 mtls=self._authenticator.certificates is not None,
                 open_services=sorted(self._open_services))

    async def aclose(self) -> None:
        """Nothing to flush."""

    def is_open(self, method: str) -> bool:
        """Whether calls of ``method`` (a full method name) need no credentials."""
        return method.lstrip("/").rpartition("/")[0] in self._open_services

    def authenticate_now(self, context: grpc.aio.ServicerContext, method: str,
                         request: Any = None) -> Principal:
        """Authenticates a call of ``method``: sets its principal (the context variable,
        the log's bound fields, the call's record) and returns it.

        Args:
            context: The call's context (its metadata and TLS peer).
            method: The full method name.
            request: The request message of a unary-request call (an assertion of a
                forwarded call is bound to it).

        Raises:
            CredentialsRejected: The call must end UNAUTHENTICATED (``error.abort(context)``);
                the refusal is already counted, logged and in the call's record.
        """
        metadata = context.invocation_metadata() or ()
        try:
            assertions = [value for key, value in metadata if key == FORWARDED_HEADER]
            if assertions:
                principal = self._forwarded(assertions, metadata, method, request)
            else:
                principal = self._authenticator.authenticate(
                    metadata, context.auth_context() if self._authenticator.certificates
                    else {})
        except CredentialsRejected as error:
            metrics.AUTH_FAILURES.labels(error.cause).inc()
            record = current_call.get()
            if record is not None:
                record.outcome = "unauthenticated"
                record.detail = f"credentials refused: {error.cause}"
            log.info("unauthenticated", cause=error.cause, method=method, peer=context.peer())
            raise
        # Each call runs in its own task, so this never leaks into another call.
        current_principal.set(principal)
        structlog.contextvars.bind_contextvars(principal=principal.id)
        record = current_call.get()
        if record is not None:
            record.principal = principal
        return principal


    def _forwarded(self, assertions: list[str | bytes], metadata: Any, method: str,
                   request: Any) -> Principal:
        """The principal of a call another replica forwarded (the assertions: the values of
        its ``stargrpc-session-forwarded``), noted as such in its record.

        Raises:
            CredentialsRejected: Not a forwarded call this replica accepts.
        """
        if self.fleet is None:
            raise CredentialsRejected("forwarded_not_accepted")
        if method not in FORWARDED_METHODS:
            raise CredentialsRejected("forwarded_other_method")
        if any(key == "authorization" for key, _ in metadata):
            # A replica never relays a caller's credentials: a call with both is not one.
            raise CredentialsRejected("forwarded_with_credentials")
        forwarded = self.fleet.verify(assertions, method=method, request=request)
        structlog.contextvars.bind_contextvars(forwarded_from=forwarded.replica)
        record: CallRecord | None = current_call.get()
        if record is not None:
            record.peer = forwarded.peer  # the caller, as the forwarding replica saw it
            record.extra["forwarded_from"] = forwarded.replica
        # With authentication off here every caller is the local principal, as ever.
        return LOCAL if self._authenticator.insecure else forwarded.principal
