"""The critic interceptor, innermost in the chain: puts every Execute under supervision.

The interceptor does not see the run (the service handler creates it), so it hands the
run's supervision policy down through a context variable instead: for Execute it wraps the
handler so that, in the call's own task, :data:`stargrpc.supervisor.current_supervision`
holds a :class:`~stargrpc.supervisor.SupervisionPolicy` — the configured soft and hard
timeouts and the caller's deadline from ``context.time_remaining()``. The server registers
:func:`stargrpc.supervisor.supervise_launched_run` as a ``Runtime.launch_hooks`` hook, which
reads the policy when the handler launches the run and attaches the supervisor. The rules
themselves live in :mod:`stargrpc.supervisor`.

Every other method, and a missing handler, passes through untouched.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from stargrpc.interceptors._shapes import WrappedHandlers
from stargrpc.service import SERVICE_NAME
from stargrpc.settings import Settings
from stargrpc.supervisor import SupervisionPolicy, current_supervision

EXECUTE_METHOD = f"/{SERVICE_NAME}/Execute"

_StreamBehavior = Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]


class CriticInterceptor(grpc.aio.ServerInterceptor):
    """Sets the supervision policy of each Execute call.

    Attributes:
        soft_timeout: Default seconds without progress before a run is stopped.
        hard_timeout: Seconds a run may take at most.
    """

    soft_timeout: float
    hard_timeout: float
    _supervised_handlers: WrappedHandlers

    def __init__(self, settings: Settings) -> None:
        self.soft_timeout = settings.critic_soft_timeout
        self.hard_timeout = settings.critic_hard_timeout
        self._supervised_handlers = WrappedHandlers()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if (handler is None or handler_call_details.method != EXECUTE_METHOD
                or handler.unary_stream is None):
            return handler
        return self._supervised_handlers.get(handler, self._supervise)

    def _supervise(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        assert handler.unary_stream is not None
        return grpc.unary_stream_rpc_method_handler(
            self._supervised(handler.unary_stream),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def policy(self, context: grpc.aio.ServicerContext) -> SupervisionPolicy:
        """The supervision policy of a call, with its deadline as an event-loop time."""
        remaining = context.time_remaining()
        deadline = None
        if remaining is not None:
            deadline = asyncio.get_running_loop().time() + remaining
        return SupervisionPolicy(self.soft_timeout, self.hard_timeout, deadline)

    def _supervised(self, behavior: _StreamBehavior) -> _StreamBehavior:
        async def supervised(request: Any, context: grpc.aio.ServicerContext
                             ) -> AsyncIterator[Any]:
            # grpc.aio serves each call in a task of its own, so the variable is seen by
            # this call's handler (which launches the run) and by nothing else.
            current_supervision.set(self.policy(context))
            async for response in behavior(request, context):
                yield response

        return supervised
