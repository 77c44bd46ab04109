"""The critic interceptor, innermost in the chain: hands each Execute its supervision policy.

The run is supervised by the runtime's run pipeline (:mod:`stargrpc.critic.supervision`),
whatever started it; this interceptor only captures what the gRPC call knows and the runtime
cannot — the caller's deadline, from ``context.time_remaining()`` — as the call's
:class:`~stargrpc.critic.supervision.SupervisionPolicy`, and passes it to the service
explicitly: the handler receives a :class:`SupervisedRequest` (the request and its policy).
Without this interceptor (an embedder's own chain) the service builds the same policy
itself, so the caller's deadline still wins.

Every other method, and a missing handler, passes through untouched.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from stargrpc.contract import SERVICE_NAME
from stargrpc.critic.supervision import SupervisedRequest, SupervisionPolicy
from stargrpc.interceptors._shapes import WrappedHandlers
from stargrpc.settings import Settings

EXECUTE_METHOD = f"/{SERVICE_NAME}/Execute"

_StreamBehavior = Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]


class CriticInterceptor(grpc.aio.ServerInterceptor):
    """Captures the supervision policy of each Execute call.

    Attributes:
        settings: The server's settings (the soft and hard timeouts).
    """

    settings: Settings
    _supervised_handlers: WrappedHandlers

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._supervised_handlers = WrappedHandlers()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if not self.applies(handler_call_details.method, handler):
            return handler
        return self._supervised_handlers.get(handler, self._supervise)

    @staticmethod
    def applies(method: str, handler: grpc.RpcMethodHandler | None) -> bool:
        """Whether calls of ``method`` served by ``handler`` get a supervision policy."""
        return (handler is not None and method == EXECUTE_METHOD
                and handler.unary_stream is not None)

    def supervised_request(self, request: Any, context: grpc.aio.ServicerContext
                           ) -> SupervisedRequest:
        """``request`` with the supervision policy of its call."""
        return SupervisedRequest(request, self.policy(context))

    def _supervise(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        assert handler.unary_stream is not None
        return grpc.unary_stream_rpc_method_handler(
            self._supervised(handler.unary_stream),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def policy(self, context: grpc.aio.ServicerContext) -> SupervisionPolicy:
        """The supervision policy of a call, with its deadline as an event-loop time."""
        return SupervisionPolicy.for_call(self.settings, context.time_remaining())

    def _supervised(self, behavior: _StreamBehavior) -> _StreamBehavior:
        async def supervised(request: Any, context: grpc.aio.ServicerContext
                             ) -> AsyncIterator[Any]:
            async for response in behavior(self.supervised_request(request, context), context):
                yield response

        return supervised
