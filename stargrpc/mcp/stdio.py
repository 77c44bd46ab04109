"""The MCP bridge over stdio, against any stargrpc server (``stargrpc mcp-stdio``), so a
desktop MCP client can launch it as a command.

Every request carries the one API key (or JWT) the bridge was started with; the server
authenticates, authorizes and audits each call as it would a gRPC caller with that key.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import anyio
import grpc
import mcp_types as types
import structlog
from mcp.server.stdio import stdio_server
from mcp.shared.message import SessionMessage
from pydantic import ValidationError

from stargrpc.client.channel import bearer_metadata, channel_credentials
from stargrpc.gateway.client import GatewayClient
from stargrpc.mcp.bridge import DEFAULT_PROGRESS_AFTER_SECONDS, Bridge
from stargrpc.text import is_text

log = structlog.get_logger("stargrpc.mcp")


async def serve_stdio(target: str, *, api_key: str | None = None, tls: bool = False,
                      ca_file: Path | None = None, cert_file: Path | None = None,
                      key_file: Path | None = None,
                      progress_after_seconds: float = DEFAULT_PROGRESS_AFTER_SECONDS) -> None:
    """Serves MCP on stdin/stdout until stdin closes.

    Args:
        target: The stargrpc server, ``host:port``.
        api_key: An API key or JWT, sent as a bearer token with every call.
        tls: Connect with TLS (implied by any certificate file).
        ca_file: PEM roots that verify the server.
        cert_file: A client certificate (mTLS), with ``key_file``.
        key_file: The client certificate's private key.
        progress_after_seconds: How long a call runs before its events are shown
            (``mcp_progress_after_seconds``).
    """
    credentials: grpc.ChannelCredentials | None = None
    if tls or ca_file or cert_file:
        credentials = channel_credentials(ca_file=ca_file, cert_file=cert_file,
                                          key_file=key_file)
    client = GatewayClient(target, credentials=credentials)
    metadata = list(bearer_metadata(api_key))
    bridge = Bridge(client, lambda ctx: metadata, progress_after_seconds=progress_after_seconds)
    await client.start()
    log.info("mcp_stdio_serving", target=target)
    try:
        async with stdio_server() as (read_stream, write_stream), \
                anyio.create_task_group() as tasks:
            readable, read = anyio.create_memory_object_stream[SessionMessage | Exception](0)
            tasks.start_soon(_answer_unreadable, read_stream, readable, write_stream)
            await bridge.server.run(read, write_stream,
                                    bridge.server.create_initialization_options())
            tasks.cancel_scope.cancel()
    finally:
        await bridge.tasks.aclose()
        await client.aclose()


async def _answer_unreadable(source: Any, sink: Any, write_stream: Any) -> None:
    """Passes on what the transport read; a line it could not read as a message is answered
    with its JSON-RPC error (the SDK's server drops it, and its caller would wait for an
    answer forever): not JSON -32700, a lone surrogate -32602, another shape -32600."""
    async with sink:
        async for item in source:
            if not isinstance(item, Exception):
                await sink.send(item)
                continue
            error = _error_for(item)
            if error is not None:
                with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
                    await write_stream.send(SessionMessage(error))


def _error_for(exc: Exception) -> types.JSONRPCError | None:
    """The answer to a line the transport could not read (None: a notification, which gets
    none)."""
    line, kind = "", ""
    if isinstance(exc, ValidationError) and exc.errors():
        given, kind = exc.errors()[0].get("input"), exc.errors()[0].get("type", "")
        line = given if isinstance(given, str) else ""
    try:
        message = json.loads(line)
    except (ValueError, RecursionError):
        return _error(None, types.PARSE_ERROR, "Parse error: the line is not JSON")
    if not isinstance(message, dict):
        return _error(None, types.INVALID_REQUEST, "Invalid Request: not a JSON object")
    request_id = message.get("id")
    if isinstance(request_id, bool) or not isinstance(request_id, int | str) or (
            isinstance(request_id, str) and not is_text(request_id)):
        if "id" not in message:
            return None  # a notification: nothing is answered, whatever it holds
        request_id = None
    if kind == "json_invalid":  # JSON to Python's json, not to pydantic's
        return _error(request_id, types.INVALID_PARAMS, "Invalid params: a string holds a "
                      "lone surrogate (an escape such as \\ud800 that is not half of a pair)")
    return _error(request_id, types.INVALID_REQUEST, "Invalid Request: not a JSON-RPC "
                  "message of MCP")


def _error(request_id: int | str | None, code: int, message: str) -> types.JSONRPCError:
    return types.JSONRPCError(jsonrpc="2.0", id=request_id,
                              error=types.ErrorData(code=code, message=message))
