"""The MCP bridge over stdio, against any stargrpc server (``stargrpc mcp-stdio``), so a
desktop MCP client can launch it as a command.

Every request carries the one API key (or JWT) the bridge was started with; the server
authenticates, authorizes and audits each call as it would a gRPC caller with that key.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import structlog
from mcp.server.stdio import stdio_server

from stargrpc.client.channel import bearer_metadata, channel_credentials
from stargrpc.gateway.client import GatewayClient
from stargrpc.mcp.bridge import DEFAULT_PROGRESS_AFTER_SECONDS, Bridge

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
        async with stdio_server() as (read_stream, write_stream):
            await bridge.server.run(read_stream, write_stream,
                                    bridge.server.create_initialization_options())
    finally:
        await bridge.tasks.aclose()
        await client.aclose()
