"""A handler that fails unexpectedly (a fault of the server's own, not a refusal), unary or
streaming:
the caller gets INTERNAL with reason INTERNAL and no word of the exception's text (which may
name a server path or a secret), the log gets the traceback, and the server keeps serving."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from structlog.testing import capture_logs

from stargrpc.server.service import ToolService
from stargrpc.sessions.registry import Sessions
from stargrpc.v1 import tool_service_pb2, tool_service_pb2_grpc
from tests.conftest import ServerFactory
from tests.helpers import status_details

LEAK = "/var/lib/stargrpc/secret-path"


async def test_an_unexpected_fault_is_internal_without_its_text(
        make_server: ServerFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    server = await make_server()

    async def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"cannot open {LEAK}")

    monkeypatch.setattr(Sessions, "create", broken)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        with capture_logs() as logs, pytest.raises(grpc.aio.AioRpcError) as failed:
            await stub.CreateSession(tool_service_pb2.CreateSessionRequest(kind="python"))
        listed = await stub.ListTools(tool_service_pb2.ListToolsRequest())
    assert failed.value.code() is grpc.StatusCode.INTERNAL
    assert LEAK not in (failed.value.details() or "")
    assert [d.reason for d in status_details(failed.value) if hasattr(d, "reason")] == [
        "INTERNAL"]
    assert listed.tools  # still serving
    failures = [line for line in logs if line["event"] == "rpc_failed"]
    assert [line["method"] for line in failures] == ["CreateSession"]
    assert failures[0]["log_level"] == "error" and failures[0]["exc_info"]


async def test_a_streaming_handlers_unexpected_fault_is_internal_too(
        make_server: ServerFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    server = await make_server()

    async def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"cannot open {LEAK}")

    monkeypatch.setattr(ToolService, "_session_replica", broken)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        with capture_logs() as logs, pytest.raises(grpc.aio.AioRpcError) as failed:
            async for _ in stub.Execute(tool_service_pb2.ExecuteRequest(
                    tool_name="echo", arguments_json='{"text": "x"}')):
                pass
        monkeypatch.undo()
        after = [r async for r in stub.Execute(tool_service_pb2.ExecuteRequest(
            tool_name="echo", arguments_json='{"text": "after"}'))]
    assert failed.value.code() is grpc.StatusCode.INTERNAL
    assert LEAK not in (failed.value.details() or "")
    assert [line["method"] for line in logs if line["event"] == "rpc_failed"] == ["Execute"]
    assert after[-1].event.result.output == "after"
