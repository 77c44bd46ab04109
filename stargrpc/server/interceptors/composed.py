"""The one way a call passes the audit, auth and critic interceptors: one wrapper per call.

:class:`ComposedInterceptor` runs up to three *stages* around a call's handler, always in
this order: the audit's record around the whole call, then — first inside the record —
authentication (unless the method is open), then the supervision policy (Execute only),
then the handler, whose responses pass through one generator. Each of
:class:`~stargrpc.server.interceptors.audit.AuditInterceptor`,
:class:`~stargrpc.server.interceptors.auth.AuthInterceptor` and
:class:`~stargrpc.server.interceptors.critic.CriticInterceptor` *is* this interceptor with only its
own stage, so chained one after another they do what one interceptor with the three stages
does, through the same code.

:func:`compose` is how a server serves its chain: each run of neighbouring stages in that
order becomes one interceptor, so a call pays one wrapper, one generator per response and
one ``intercept_service`` instead of three (the figure is in ``bench/README.md``).
Anything else in the chain — an embedder's interceptor between two of them — stays where it
is, and splits the run there.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol

import grpc

from stargrpc.errors import RequestError
from stargrpc.server.interceptors._shapes import (
    WrappedHandlers,
    call_behaviour,
    responses_of,
    rewrap,
)

_Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]

#: What runs first inside a call (authentication, the supervision policy): given the
#: request and the call's context, it returns the request to hand on, or raises a
#: RequestError that ends the call.
Gate = Callable[[Any, grpc.aio.ServicerContext], Any]


class AuditStage(Protocol):
    """The record around a call (:class:`~stargrpc.server.interceptors.audit.AuditInterceptor`)."""

    def open_call(self, method: str) -> Any:
        """Opens the record of a call of ``method`` in this task, before anything else."""

    def call_of_task(self) -> Any:
        """The call :meth:`open_call` opened in this task."""

    def unknown_method(self, call: Any) -> None:
        """Writes the record of a call of a method that does not exist."""

    def begin(self, call: Any, request: Any, context: grpc.aio.ServicerContext) -> None:
        """Notes what the call's context and request say, as its handler starts."""

    def conclude(self, call: Any, context: grpc.aio.ServicerContext | None,
                 exc: BaseException | None) -> Any:
        """Names the call's outcome and writes its record (once)."""


class AuthStage(Protocol):
    """Authentication (:class:`~stargrpc.server.interceptors.auth.AuthInterceptor`)."""

    def is_open(self, method: str) -> bool:
        """Whether calls of ``method`` need no credentials."""

    def authenticate_now(self, context: grpc.aio.ServicerContext, method: str,
                         request: Any = None) -> Any:
        """Sets the call's principal, or raises a RequestError (UNAUTHENTICATED); ``request``
        is the call's request message (a forwarded call's assertion is bound to it)."""


class CriticStage(Protocol):
    """The supervision policy (:class:`~stargrpc.server.interceptors.critic.CriticInterceptor`)."""

    def applies(self, method: str, handler: grpc.RpcMethodHandler | None) -> bool:
        """Whether calls of ``method`` served by ``handler`` get a supervision policy."""

    def supervised_request(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """``request`` with the supervision policy of its call."""


class ComposedInterceptor(grpc.aio.ServerInterceptor):
    """Up to three stages — audit, auth, critic — around each call, as one wrapper.

    Attributes:
        audit: The outermost stage: the call's record (None when absent).
        auth: Authentication, first inside the record (None when absent).
        critic: The supervision policy of Execute calls (None when absent).
    """

    audit: AuditStage | None
    auth: AuthStage | None
    critic: CriticStage | None
    _wrapped: WrappedHandlers

    def __init__(self, *, audit: AuditStage | None = None, auth: AuthStage | None = None,
                 critic: CriticStage | None = None) -> None:
        self.audit = audit
        self.auth = auth
        self.critic = critic
        self._wrapped = WrappedHandlers()

    @property
    def stages(self) -> tuple[AuditStage | None, AuthStage | None, CriticStage | None]:
        """``(audit, auth, critic)``, absent ones None."""
        return self.audit, self.auth, self.critic

    async def intercept_service(self, continuation: _Continuation,
                                handler_call_details: grpc.HandlerCallDetails
                                ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        audit = self.audit
        call: Any = None
        if audit is None:
            handler = await continuation(handler_call_details)
        else:
            call = audit.open_call(method)
            try:
                handler = await continuation(handler_call_details)
            except BaseException as exc:  # no handler could even be found
                audit.conclude(call, None, exc)
                raise
        if handler is None:
            if self.auth is None or self.auth.is_open(method):
                if audit is not None:
                    audit.unknown_method(call)
                return None
            # Probing for methods needs credentials too: with them, UNIMPLEMENTED. Built
            # per call, not cached: the names a prober tries are unbounded.
            return self._wrap(_UNIMPLEMENTED, method)
        return self._wrapped.get(handler, lambda h: self._wrap(h, method), key=method)

    def _wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        gate = self._gate(method, handler)
        if self.audit is None and gate is None:
            return handler  # nothing of this call is ours: pass it through untouched

        def unary(inner: Callable[..., Any], streaming: bool) -> Callable[..., Any]:
            return self._unary(lambda request, context: call_behaviour(inner, request, context),
                               peek=not streaming, gate=gate)

        def stream(inner: Callable[..., Any], streaming: bool) -> Callable[..., Any]:
            return self._stream(responses_of(inner), peek=not streaming, gate=gate)

        # The request is noted in the record only when it is one message, not a stream.
        return rewrap(handler, unary=unary, stream=stream)

    def _gate(self, method: str, handler: grpc.RpcMethodHandler) -> Gate | None:
        """What runs first inside the record of a call of ``method``: authentication (unless
        the method is open), then the supervision policy (when the critic applies)."""
        auth = self.auth if self.auth is not None and not self.auth.is_open(method) else None
        critic = (self.critic if self.critic is not None and self.critic.applies(method, handler)
                  else None)
        if auth is not None and critic is not None:
            authenticate_now, supervised = auth.authenticate_now, critic.supervised_request

            def authenticated_and_supervised(request: Any,
                                             context: grpc.aio.ServicerContext) -> Any:
                authenticate_now(context, method, request)
                return supervised(request, context)

            return authenticated_and_supervised
        if auth is not None:
            authenticate_only = auth.authenticate_now

            def authenticated(request: Any, context: grpc.aio.ServicerContext) -> Any:
                authenticate_only(context, method, request)
                return request

            return authenticated
        if critic is not None:
            return critic.supervised_request
        return None

    def _unary(self, behavior: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]], *,
               peek: bool, gate: Gate | None
               ) -> Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]:
        """``behavior`` (a coroutine function) behind ``gate``, inside the record."""
        audit = self.audit
        if audit is None:
            assert gate is not None

            async def gated(request: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    request = gate(request, context)
                except RequestError as error:
                    await error.abort(context)
                return await behavior(request, context)

            return gated

        async def audited(request: Any, context: grpc.aio.ServicerContext) -> Any:
            call = audit.call_of_task()
            try:
                # Inside the try: whatever fails from here on, the record is written.
                audit.begin(call, request if peek else None, context)
                if gate is not None:
                    try:
                        request = gate(request, context)
                    except RequestError as error:
                        await error.abort(context)
                response = await behavior(request, context)
            except BaseException as exc:
                audit.conclude(call, context, exc)
                raise
            audit.conclude(call, context, None)
            return response

        return audited

    def _stream(self, behavior: Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]],
                *, peek: bool, gate: Gate | None
                ) -> Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]:
        """``behavior`` (returning an async iterator of responses) behind ``gate``, inside
        the record."""
        audit = self.audit
        if audit is None:
            assert gate is not None

            async def gated(request: Any, context: grpc.aio.ServicerContext
                            ) -> AsyncIterator[Any]:
                try:
                    request = gate(request, context)
                except RequestError as error:
                    await error.abort(context)
                async for response in behavior(request, context):
                    yield response

            return gated

        async def audited(request: Any, context: grpc.aio.ServicerContext
                          ) -> AsyncIterator[Any]:
            call = audit.call_of_task()
            try:
                # Inside the try: whatever fails from here on, the record is written.
                audit.begin(call, request if peek else None, context)
                if gate is not None:
                    try:
                        request = gate(request, context)
                    except RequestError as error:
                        await error.abort(context)
                async for response in behavior(request, context):
                    yield response
            except BaseException as exc:
                audit.conclude(call, context, exc)
                raise
            audit.conclude(call, context, None)

        return audited


async def _unimplemented(requests: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")


#: The handler of a method that does not exist, once authentication let the call through.
#: Raw bytes in, so it fits a call of any shape.
_UNIMPLEMENTED = grpc.stream_stream_rpc_method_handler(_unimplemented)


def compose(chain: Sequence[grpc.aio.ServerInterceptor]) -> list[grpc.aio.ServerInterceptor]:
    """``chain`` with each run of neighbouring stages in the order audit → auth → critic
    served as one :class:`ComposedInterceptor`; everything else as it is.

    A stage is a :class:`ComposedInterceptor` that serves calls its own way only when a
    subclass overrides ``intercept_service``: such an interceptor is left as it is.
    """
    composed: list[grpc.aio.ServerInterceptor] = []
    run: list[ComposedInterceptor] = []

    def close_run() -> None:
        if len(run) == 1:
            composed.append(run[0])
        elif run:
            audit, auth, critic = (next((s for s in stages if s is not None), None)
                                   for stages in zip(*(i.stages for i in run), strict=True))
            composed.append(ComposedInterceptor(audit=audit, auth=auth, critic=critic))
        run.clear()

    for interceptor in chain:
        if not _fusable(interceptor):
            close_run()
            composed.append(interceptor)
            continue
        if run and _first_stage(interceptor) <= _last_stage(run[-1]):
            close_run()  # out of order, or a stage twice: a run of its own
        run.append(interceptor)
    close_run()
    return composed


def _fusable(interceptor: grpc.aio.ServerInterceptor) -> bool:
    return (isinstance(interceptor, ComposedInterceptor)
            and type(interceptor).intercept_service is ComposedInterceptor.intercept_service
            and any(stage is not None for stage in interceptor.stages))


def _first_stage(interceptor: ComposedInterceptor) -> int:
    return next(i for i, stage in enumerate(interceptor.stages) if stage is not None)


def _last_stage(interceptor: ComposedInterceptor) -> int:
    return max(i for i, stage in enumerate(interceptor.stages) if stage is not None)
