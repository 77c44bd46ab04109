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

from typing import Any

import grpc

from stargrpc.contract import SERVICE_NAME
from stargrpc.critic.supervision import SupervisedRequest, SupervisionPolicy
from stargrpc.server.interceptors.composed import ComposedInterceptor
from stargrpc.settings import Settings

EXECUTE_METHOD = f"/{SERVICE_NAME}/Execute"


class CriticInterceptor(ComposedInterceptor):
    """Captures the supervision policy of each Execute call: the composed interceptor
    (:mod:`stargrpc.server.interceptors.composed`) with only its critic stage, which is this object.

    Attributes:
        settings: The server's settings (the soft and hard timeouts).
    """

    settings: Settings

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        super().__init__(critic=self)

    @staticmethod
    def applies(method: str, handler: grpc.RpcMethodHandler | None) -> bool:
        """Whether calls of ``method`` served by ``handler`` get a supervision policy."""
        return (handler is not None and method == EXECUTE_METHOD
                and handler.unary_stream is not None)

    def supervised_request(self, request: Any, context: grpc.aio.ServicerContext
                           ) -> SupervisedRequest:
        """``request`` with the supervision policy of its call."""
        return SupervisedRequest(request, self.policy(context))

    def policy(self, context: grpc.aio.ServicerContext) -> SupervisionPolicy:
        """The supervision policy of a call, with its deadline as an event-loop time."""
        return SupervisionPolicy.for_call(self.settings, context.time_remaining())

