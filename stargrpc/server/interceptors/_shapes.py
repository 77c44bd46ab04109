"""The four call shapes of gRPC, for interceptors that wrap a handler's behaviour.

grpc.aio serves a coroutine, an async generator and a plain function differently, so a
wrapper must keep the shape of what it wraps. :func:`rewrap` rebuilds a handler of the
same shape around a wrapped behaviour; :func:`call_behaviour` and
:func:`responses_of` run any behaviour from inside an async wrapper;
:class:`WrappedHandlers` keeps each wrapped handler so it is built once per method.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc

#: Wraps a behaviour; told whether the call streams its requests (when it does, the
#: wrapper's ``request`` argument is the request iterator, not a message).
Wrap = Callable[[Callable[..., Any], bool], Callable[..., Any]]

_END = object()

#: Wrapped handlers a cache keeps: one per method served; the bound is for a handler built
#: afresh on every call, which would otherwise grow the cache without end.
MAX_WRAPPED_HANDLERS = 1024


class WrappedHandlers:
    """An interceptor's wrapped handlers, built once per handler (and key) rather than on
    every call: grpc.aio hands an interceptor the same handler object for every call of a
    method, so what varies per call must reach the wrapper another way (a context variable,
    or the servicer context)."""

    def __init__(self) -> None:
        self._wrapped: dict[tuple[int, object], tuple[grpc.RpcMethodHandler,
                                                      grpc.RpcMethodHandler]] = {}

    def get(self, handler: grpc.RpcMethodHandler,
            build: Callable[[grpc.RpcMethodHandler], grpc.RpcMethodHandler],
            key: object = None) -> grpc.RpcMethodHandler:
        """``build(handler)``, from the cache when it was built before for this handler
        object and ``key``."""
        cached = self._wrapped.get((id(handler), key))
        if cached is not None and cached[0] is handler:  # not a new object at a reused id
            return cached[1]
        wrapped = build(handler)
        if len(self._wrapped) < MAX_WRAPPED_HANDLERS:
            self._wrapped[(id(handler), key)] = (handler, wrapped)
        return wrapped


def rewrap(handler: grpc.RpcMethodHandler, *, unary: Wrap, stream: Wrap
           ) -> grpc.RpcMethodHandler:
    """``handler`` with its behaviour wrapped, keeping its shape and codec.

    Args:
        handler: The handler to wrap.
        unary: Wraps a behaviour that returns once: unary responses, and streaming responses
            written with ``context.write()`` by a coroutine.
        stream: Wraps a behaviour that yields its responses (it must return an async
            generator function).
    """
    codec = {"request_deserializer": handler.request_deserializer,
             "response_serializer": handler.response_serializer}
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary, False), **codec)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary, True), **codec)
    streaming = handler.unary_stream is None
    inner = handler.stream_stream if streaming else handler.unary_stream
    assert inner is not None
    wrapped = (unary(inner, streaming) if inspect.iscoroutinefunction(inner)
               else stream(inner, streaming))
    make = (grpc.stream_stream_rpc_method_handler if streaming
            else grpc.unary_stream_rpc_method_handler)
    return make(wrapped, **codec)


async def call_behaviour(behaviour: Callable[..., Any], request: Any,
                         context: grpc.aio.ServicerContext) -> Any:
    """Awaits a coroutine behaviour, or runs a plain one off the event loop (as grpc.aio
    itself would)."""
    if inspect.iscoroutinefunction(behaviour):
        return await behaviour(request, context)
    return await asyncio.to_thread(behaviour, request, context)


def responses_of(behaviour: Callable[..., Any]
                 ) -> Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]:
    """A streaming behaviour as an async generator function, decided once when a handler
    is wrapped: an async generator function as it is (a wrapping generator would add a hop
    per streamed message), a plain generator function run off the event loop."""
    if inspect.isasyncgenfunction(behaviour):
        return behaviour
    return functools.partial(_iterate_off_the_loop, behaviour)


async def _iterate_off_the_loop(behaviour: Callable[..., Any], request: Any,
                                context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
    responses: Iterator[Any] = await asyncio.to_thread(behaviour, request, context)
    while (response := await asyncio.to_thread(next, responses, _END)) is not _END:
        yield response
