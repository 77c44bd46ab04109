"""Helpers shared by the session tests."""

from __future__ import annotations

from typing import Any

import grpc

from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.helpers import run_tool, status_details


async def create(stub: tool_service_pb2_grpc.ToolServiceStub, kind: str = "python",
                 **fields: Any) -> str:
    """A new session's id."""
    reply = await stub.CreateSession(tool_service_pb2.CreateSessionRequest(kind=kind, **fields))
    return reply.session.session_id


async def python(stub: tool_service_pb2_grpc.ToolServiceStub, session_id: str, code: str,
                 **fields: Any) -> events_pb2.Result:
    """The Result of ``code`` run by the python tool in the session."""
    events = await run_tool(stub, "python", {"code": code}, session_id=session_id, **fields)
    return events[-1].result


def reason(error: grpc.aio.AioRpcError) -> str:
    """The ErrorInfo reason of a refused call."""
    return next(d.reason for d in status_details(error) if hasattr(d, "reason"))


async def open_sessions(stub: tool_service_pb2_grpc.ToolServiceStub) -> list[str]:
    """The ids of the caller's open sessions."""
    listed = await stub.ListSessions(tool_service_pb2.ListSessionsRequest())
    return [s.session_id for s in listed.sessions]
