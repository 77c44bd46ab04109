"""The audit, auth and critic interceptors served as one: one wrapper per call.

Each of the three is a complete interceptor of its own (an embedder may chain any of them),
and chained they each wrap the handler: a call then runs three wrapping behaviours — for a
stream, three generators every response passes through — and three ``intercept_service``
coroutines. :func:`compose` serves an ``audit → auth → critic`` run of the chain, in that
order, as one :class:`ComposedInterceptor`: the audit's record around the call, with the
authentication and the supervision policy run first inside it (the audit's ``gate``), and
the handler's responses passed on by the audit's one generator. What each layer does, and in
which order, is unchanged; only the wrapping is shared.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

from stargrpc.interceptors._shapes import (
    WrappedHandlers,
    call_behaviour,
    responses_of,
    rewrap,
)
from stargrpc.interceptors.audit import AuditInterceptor, Gate
from stargrpc.interceptors.auth import AuthInterceptor
from stargrpc.interceptors.critic import CriticInterceptor

_Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]


class ComposedInterceptor(grpc.aio.ServerInterceptor):
    """The audit interceptor with the auth and critic interceptors that follow it, as one.

    Attributes:
        audit: The outermost layer: the call's record.
        auth: Authentication, first inside the record (None when not in the chain).
        critic: The supervision policy of Execute calls (None when not in the chain).
    """

    audit: AuditInterceptor
    auth: AuthInterceptor | None
    critic: CriticInterceptor | None
    _wrapped: WrappedHandlers

    def __init__(self, audit: AuditInterceptor, auth: AuthInterceptor | None = None,
                 critic: CriticInterceptor | None = None) -> None:
        self.audit = audit
        self.auth = auth
        self.critic = critic
        self._wrapped = WrappedHandlers()

    async def intercept_service(self, continuation: _Continuation,
                                handler_call_details: grpc.HandlerCallDetails
                                ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        audit = self.audit
        call = audit.open_call(method)
        try:
            handler = await continuation(handler_call_details)
        except BaseException as exc:
            audit.conclude_failed(call, exc)
            raise
        if handler is None:
            if self.auth is None or self.auth.is_open(method):
                audit.unknown_method(call)
                return None
            # Probing for methods needs credentials too; this handler checks them itself.
            return audit.wrap(self.auth.unknown_method(method))
        return self._wrapped.get(handler, lambda h: self._wrap(h, method), key=method)

    def _wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        gate = self._gate(method, handler)
        audit = self.audit

        def unary(inner: Callable[..., Any], streaming: bool) -> Callable[..., Any]:
            return audit.audited_unary(
                lambda request, context: call_behaviour(inner, request, context),
                peek=not streaming, gate=gate)

        def stream(inner: Callable[..., Any], streaming: bool) -> Callable[..., Any]:
            return audit.audited_stream(responses_of(inner), peek=not streaming, gate=gate)

        return rewrap(handler, unary=unary, stream=stream)

    def _gate(self, method: str, handler: grpc.RpcMethodHandler) -> Gate | None:
        """What runs first inside the record of a call of ``method``: authentication (unless
        the method is open), then the supervision policy (Execute only)."""
        auth = self.auth if self.auth is not None and not self.auth.is_open(method) else None
        critic = (self.critic if self.critic is not None and self.critic.applies(method, handler)
                  else None)
        if auth is not None and critic is not None:
            authenticate_now, supervised = auth.authenticate_now, critic.supervised_request

            def authenticated_and_supervised(request: Any,
                                             context: grpc.aio.ServicerContext) -> Any:
                authenticate_now(context, method)
                return supervised(request, context)

            return authenticated_and_supervised
        if auth is not None:
            authenticate_only = auth.authenticate_now

            def authenticated(request: Any, context: grpc.aio.ServicerContext) -> Any:
                authenticate_only(context, method)
                return request

            return authenticated
        if critic is not None:
            return critic.supervised_request
        return None


def compose(chain: Sequence[grpc.aio.ServerInterceptor]) -> list[grpc.aio.ServerInterceptor]:
    """``chain`` with its ``audit``, ``auth``, ``critic`` run (in that order, auth or critic
    possibly absent) served as one :class:`ComposedInterceptor`; everything else, and any
    other order, as it is."""
    composed: list[grpc.aio.ServerInterceptor] = []
    index = 0
    while index < len(chain):
        audit = chain[index]
        if type(audit) is not AuditInterceptor:
            composed.append(audit)
            index += 1
            continue
        index += 1
        auth = critic = None
        if index < len(chain) and type(chain[index]) is AuthInterceptor:
            auth = chain[index]
            index += 1
        if index < len(chain) and type(chain[index]) is CriticInterceptor:
            critic = chain[index]
            index += 1
        composed.append(ComposedInterceptor(audit, auth, critic))
    return composed
