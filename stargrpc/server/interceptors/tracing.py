"""The tracing interceptor (``tracing = true``), outermost in the chain: a SERVER span per
ToolService call, named like ``stargrpc.v1.ToolService/Execute``, parented by the W3C trace
context (``traceparent``/``tracestate``) of the call's metadata and current for the call's
task, so the run's span (:mod:`stargrpc.tracing`) nests under it. The HTTP gateway forwards
these headers, so a browser's or proxy's trace continues here. Other services (health,
reflection) pass through untraced: they are noise in a trace.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import grpc
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from stargrpc.contract import SERVICE_NAME
from stargrpc.server.interceptors._shapes import (
    WrappedHandlers,
    call_behaviour,
    responses_of,
    rewrap,
)
from stargrpc.settings import Settings
from stargrpc.tracing import configure_tracing, tracer

#: The service whose calls get spans.
TRACED_SERVICE = SERVICE_NAME

# gRPC codes that mark a server span as failed (OpenTelemetry's RPC conventions): the
# others (NOT_FOUND, PERMISSION_DENIED, …) are the caller's problem, not the server's.
_SERVER_ERROR_CODES = frozenset({
    grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DATA_LOSS,
})

_Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]


class TracingInterceptor(grpc.aio.ServerInterceptor):
    """A SERVER span per ToolService call (see the module docstring)."""

    _wrapped: WrappedHandlers

    def __init__(self, settings: Settings) -> None:
        configure_tracing(settings)
        self._wrapped = WrappedHandlers()

    async def start(self) -> None:
        """Nothing to start (see :class:`stargrpc.server.Lifecycle`)."""

    async def aclose(self) -> None:
        """Flushes spans not exported yet."""
        flush = getattr(trace.get_tracer_provider(), "force_flush", None)
        if flush is not None:
            await asyncio.to_thread(flush)

    async def intercept_service(self, continuation: _Continuation,
                                handler_call_details: grpc.HandlerCallDetails
                                ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(f"/{TRACED_SERVICE}/"):
            return handler
        name = method.lstrip("/")
        # Keyed by the method as well: the span's name is built into the wrapper.
        return self._wrapped.get(handler, lambda inner: _traced(inner, name), key=name)


def _traced(handler: grpc.RpcMethodHandler, name: str) -> grpc.RpcMethodHandler:
    def unary(behaviour: Callable[..., Any], _streaming: bool) -> Callable[..., Any]:
        async def traced(request: Any, context: grpc.aio.ServicerContext) -> Any:
            with _call_span(name, context):
                return await call_behaviour(behaviour, request, context)

        return traced

    def stream(behaviour: Callable[..., Any], _streaming: bool) -> Callable[..., Any]:
        responses_from = responses_of(behaviour)

        async def traced(request: Any, context: grpc.aio.ServicerContext
                         ) -> AsyncIterator[Any]:
            # grpc.aio serves each call in a task of its own, which iterates this
            # generator: the span is current for the whole call and for nothing else.
            with _call_span(name, context):
                async for response in responses_from(request, context):
                    yield response

        return traced

    return rewrap(handler, unary=unary, stream=stream)


@contextmanager
def _call_span(name: str, context: grpc.aio.ServicerContext) -> Iterator[Span]:
    carrier = {key: value for key, value in (context.invocation_metadata() or ())
               if isinstance(value, str)}
    service, _, method = name.partition("/")
    with tracer().start_as_current_span(
            name, context=propagate.extract(carrier), kind=SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": method},
            record_exception=False, set_status_on_exception=False) as span:
        try:
            yield span
        except BaseException as exc:
            code = context.code() if isinstance(exc, grpc.aio.AbortError) else None
            if code is None:  # a real fault (or a cancelled call), not a refusal
                span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise
        finally:
            code = context.code()
            if isinstance(code, grpc.StatusCode):
                span.set_attribute("rpc.grpc.status_code", code.value[0])
                if code in _SERVER_ERROR_CODES:
                    span.set_status(Status(StatusCode.ERROR, code.name))
