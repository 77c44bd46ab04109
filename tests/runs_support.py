"""Support for the run tests (WatchRun, CancelRun, idempotency, limits, large files, Redis):
the test tools, a principal from a metadata header, and stream helpers."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from stargrpc.principal import Principal, current_principal
from stargrpc.registry import Registry, load_directory, load_registry
from stargrpc.v1 import events_pb2, tool_service_pb2

#: The test tools (tally, blob, chatter), loadable as a tools directory by a server process.
RUN_TOOLS_DIR = Path(__file__).parent / "run_tools"


def run_registry() -> Registry:
    """The bundled tools plus the test tools."""
    return Registry([*load_registry().values(), *load_directory(RUN_TOOLS_DIR)])


class HeaderPrincipal(grpc.aio.ServerInterceptor):
    """Test stand-in for authentication: the principal is named by the ``x-test-principal``
    header, its roles by ``x-test-roles`` (comma separated)."""

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails],
                                     Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        metadata = dict(details.invocation_metadata or ())
        name = metadata.get("x-test-principal")
        if name:
            roles = frozenset(r for r in str(metadata.get("x-test-roles", "")).split(",") if r)
            current_principal.set(Principal(id=str(name), roles=roles, method="test"))
        return await continuation(details)


def as_principal(name: str, *roles: str) -> tuple[tuple[str, str], ...]:
    """Call metadata naming the principal for :class:`HeaderPrincipal`."""
    return (("x-test-principal", name), ("x-test-roles", ",".join(roles)))


def execute_request(tool_name: str, arguments: dict[str, Any] | None = None,
                    **fields: Any) -> tool_service_pb2.ExecuteRequest:
    """An ExecuteRequest with JSON arguments."""
    import json

    request = tool_service_pb2.ExecuteRequest(tool_name=tool_name, **fields)
    request.arguments_json = json.dumps(arguments or {})
    return request


async def collect(call: Any) -> list[events_pb2.RunEvent]:
    """Every (remaining) event of an Execute or WatchRun stream; mixes with ``read()``."""
    events = []
    while (response := await call.read()) is not grpc.aio.EOF:
        events.append(response.event)
    return events


def key() -> str:
    """A fresh idempotency key."""
    return uuid.uuid4().hex


def stripped(events: list[events_pb2.RunEvent]) -> list[bytes]:
    """Events as bytes, for comparing two streams of the same run."""
    return [event.SerializeToString(deterministic=True) for event in events]
