"""What the authentication tests share."""

from __future__ import annotations

import grpc

from stargrpc.v1 import events_pb2, tool_service_pb2_grpc
from tests.helpers import key_channel, run_tool


async def whoami(target: str, token: str) -> str:
    """whoami's output, or the status code name when the call is refused."""
    async with key_channel(target, token) as channel:
        try:
            events = await run_tool(tool_service_pb2_grpc.ToolServiceStub(channel), "whoami", {})
        except grpc.aio.AioRpcError as error:
            assert error.details() == "missing or invalid credentials"
            return error.code().name
    assert events[-1].result.outcome == events_pb2.OUTCOME_OK
    return events[-1].result.output
