"""The wrapped-handler cache the interceptors share: one build per handler and key."""

from __future__ import annotations

import grpc

from stargrpc.server.interceptors._shapes import WrappedHandlers


def _handler() -> grpc.RpcMethodHandler:
    async def behaviour(request: object, context: object) -> None:
        return None

    return grpc.unary_unary_rpc_method_handler(behaviour)


def test_a_handler_is_wrapped_once_per_key() -> None:
    cache = WrappedHandlers()
    builds: list[grpc.RpcMethodHandler] = []

    def build(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        builds.append(handler)
        return _handler()

    first, second = _handler(), _handler()
    wrapped = cache.get(first, build)

    assert cache.get(first, build) is wrapped
    assert cache.get(second, build) is not wrapped
    assert cache.get(first, build, key="/other/Method") is not wrapped
    assert builds == [first, second, first]
