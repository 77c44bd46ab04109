"""The authentication interceptor: every call gets a principal or ends UNAUTHENTICATED.

It wraps the handler of every method (all four call shapes, and methods that do not exist,
so probing for them needs credentials too) with a check that runs first inside the call:
it reads the ``authorization`` metadata and the TLS peer, sets
:data:`stargrpc.principal.current_principal` (and binds ``principal`` for the logs), and
fills the open :class:`~stargrpc.call_record.CallRecord`. Refusals are UNAUTHENTICATED with the
same generic message whatever went wrong; the cause goes to the log and the
``tool_executor_auth_failures`` metric only. Health checks and reflection are open by
default (``auth_open_health``, ``auth_open_reflection``). Which tools a principal may run
is decided later, by :mod:`stargrpc.permissions`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import structlog

from stargrpc import metrics
from stargrpc.auth.authenticator import Authenticator
from stargrpc.call_record import current_call
from stargrpc.errors import CredentialsRejected
from stargrpc.interceptors._shapes import (
    WrappedHandlers,
    call_behaviour,
    responses_of,
    rewrap,
)
from stargrpc.principal import Principal, current_principal
from stargrpc.settings import Settings

log = structlog.get_logger("stargrpc.auth")

_HEALTH = frozenset({"grpc.health.v1.Health"})
_REFLECTION = frozenset({"grpc.reflection.v1alpha.ServerReflection",
                         "grpc.reflection.v1.ServerReflection"})
_LOOPBACK = ("127.", "::1", "[::1]", "localhost")

Authenticate = Callable[[grpc.aio.ServicerContext], Awaitable[Principal]]


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Authenticates every call before its handler runs."""

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
        self._guarded = WrappedHandlers()

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

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails],
                                     Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        handler = await continuation(handler_call_details)
        if self.is_open(method):
            return handler
        if handler is None:
            return self.unknown_method(method)
        return self._guarded.get(handler, lambda h: guard(h, self._authenticator_for(method)),
                                 key=method)

    def is_open(self, method: str) -> bool:
        """Whether calls of ``method`` (a full method name) need no credentials."""
        return method.lstrip("/").rpartition("/")[0] in self._open_services

    def unknown_method(self, method: str) -> grpc.RpcMethodHandler:
        """The handler of ``method``, which does not exist: UNAUTHENTICATED without
        credentials, UNIMPLEMENTED with them."""
        return _unknown_method(self._authenticator_for(method))

    def _authenticator_for(self, method: str) -> Authenticate:
        async def authenticate(context: grpc.aio.ServicerContext) -> Principal:
            return await self._admit(context, method)

        return authenticate

    async def _admit(self, context: grpc.aio.ServicerContext, method: str) -> Principal:
        try:
            return self.authenticate_now(context, method)
        except CredentialsRejected as error:
            await error.abort(context)
            raise  # abort raises; this keeps type checkers and readers sure of it

    def authenticate_now(self, context: grpc.aio.ServicerContext, method: str) -> Principal:
        """Authenticates a call of ``method``: sets its principal (the context variable,
        the log's bound fields, the call's record) and returns it.

        Raises:
            CredentialsRejected: The call must end UNAUTHENTICATED (``error.abort(context)``);
                the refusal is already counted, logged and in the call's record.
        """
        try:
            principal = self._authenticator.authenticate(
                context.invocation_metadata() or (),
                context.auth_context() if self._authenticator.certificates else {})
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


def guard(handler: grpc.RpcMethodHandler, authenticate: Authenticate) -> grpc.RpcMethodHandler:
    """``handler`` with ``authenticate`` awaited before its behaviour, for any call shape."""
    return rewrap(handler, unary=lambda inner, _: _unary_response(inner, authenticate),
                  stream=lambda inner, _: _stream_response(inner, authenticate))


def _unary_response(inner: Callable[..., Any], authenticate: Authenticate) -> Callable[..., Any]:
    async def behaviour(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await authenticate(context)
        return await call_behaviour(inner, request, context)

    return behaviour


def _stream_response(inner: Callable[..., Any], authenticate: Authenticate) -> Callable[..., Any]:
    responses_from = responses_of(inner)

    async def generator(request: Any, context: grpc.aio.ServicerContext
                        ) -> AsyncIterator[Any]:
        await authenticate(context)
        async for response in responses_from(request, context):
            yield response

    return generator


def _unknown_method(authenticate: Authenticate) -> grpc.RpcMethodHandler:
    """A handler for a method that does not exist: UNAUTHENTICATED without credentials,
    UNIMPLEMENTED with them. Raw bytes in, so it fits a call of any shape."""

    async def behaviour(requests: Any, context: grpc.aio.ServicerContext) -> None:
        await authenticate(context)
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")

    return grpc.stream_stream_rpc_method_handler(behaviour)
