"""The MCP endpoint of a server process: streamable HTTP at ``/mcp`` on ``mcp_port``.

It is a :class:`~stargrpc.mcp.bridge.Bridge` on a loopback gRPC channel to the process's
own ToolService; each MCP request's ``Authorization`` header (with the trace context) is
forwarded as the gRPC call's credentials.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from typing import Any

import structlog
from mcp.server.transport_security import TransportSecuritySettings
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from stargrpc.forwarded import ForwardedClient
from stargrpc.gateway.app import call_metadata
from stargrpc.gateway.client import GatewayClient, Metadata
from stargrpc.http_guard import RequestGuard
from stargrpc.http_server import AsgiServer, gateway_tls, grpc_target
from stargrpc.mcp.bridge import Bridge
from stargrpc.settings import Settings

log = structlog.get_logger("stargrpc.mcp")

#: The path of the endpoint.
MCP_PATH = "/mcp"


def request_credentials(ctx: Any, forwarded: ForwardedClient | None = None) -> Metadata:
    """The gRPC metadata of the HTTP request behind an MCP request (none on other
    transports); ``forwarded`` vouches for the HTTP client's address to the audit."""
    request = ctx.request
    return call_metadata(request, forwarded) if isinstance(request, Request) else []


class RequireBearer:
    """Answers 401 with ``WWW-Authenticate: Bearer`` to a request without credentials, so an
    MCP client knows to ask for a token; the credentials given are checked by the service."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not any(
                name == b"authorization" for name, _ in scope.get("headers", ())):
            body = (b'{"jsonrpc":"2.0","id":null,"error":{"code":-32001,'
                    b'"message":"missing credentials: send Authorization: Bearer <key or JWT>"}}')
            await send({"type": "http.response.start", "status": 401, "headers": [
                (b"content-type", b"application/json"),
                (b"www-authenticate", b'Bearer realm="stargrpc"'),
                (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)


class McpEndpoint:
    """The streamable-HTTP MCP endpoint of one server.

    Attributes:
        port: The bound port, once started.
    """

    port: int
    _settings: Settings
    _client: GatewayClient
    _bridge: Bridge
    _http: AsgiServer | None
    _manager_task: asyncio.Task[None] | None
    _manager_stop: asyncio.Event

    def __init__(self, settings: Settings, grpc_port: int, *,
                 forwarded: ForwardedClient | None = None) -> None:
        """The endpoint of the server whose gRPC port is ``grpc_port``; ``forwarded``
        vouches for each HTTP client's address to the server's audit.

        Raises:
            OSError: With TLS on, a certificate file cannot be read.
        """
        self._settings = settings
        credentials, server_name = gateway_tls(settings)
        self._client = GatewayClient(grpc_target(settings, grpc_port), credentials=credentials,
                                     server_name=server_name)
        self._bridge = Bridge(self._client,
                              functools.partial(request_credentials, forwarded=forwarded))
        self._http = None
        self._manager_task = None
        self._manager_stop = asyncio.Event()
        self.port = 0

    async def start(self) -> int:
        """Opens the channel, starts the MCP sessions' task group, binds and serves.

        Returns:
            The bound port.

        Raises:
            OSError: The port cannot be bound.
        """
        try:
            return await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> int:
        s = self._settings
        host = s.mcp_host or s.host
        await self._client.start()
        app: ASGIApp = self._bridge.server.streamable_http_app(
            streamable_http_path=MCP_PATH, host=host,
            max_request_body_size=s.max_receive_message_bytes,
            # Host and Origin are the guard's, as on the gateway: the SDK's own check knows
            # only loopback names, and only when bound to loopback.
            transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False))
        if not s.insecure_no_auth:
            app = RequireBearer(app)
        app = RequestGuard(app, allowed_hosts=s.http_allowed_hosts,
                           allowed_origins=s.http_allowed_origins)
        started = asyncio.Event()
        manager = self._bridge.server.session_manager

        async def run_sessions() -> None:
            # The manager's task group must be entered and left in one task.
            async with manager.run():
                started.set()
                await self._manager_stop.wait()

        self._manager_task = asyncio.create_task(run_sessions(), name="mcp-sessions")
        await started.wait()
        self._http = AsgiServer("mcp", app, host, s.mcp_port or 0, reuse_port=s.workers > 1,
                                trusted_proxies=s.http_trusted_proxies)
        self.port = await self._http.start()
        log.info("mcp_serving", url=f"http://{host}:{self.port}{MCP_PATH}")
        return self.port

    async def stop(self) -> None:
        """Stops serving, ends the MCP sessions and closes the channel; idempotent."""
        # The sessions first: their open streams would hold the HTTP server's shutdown.
        self._manager_stop.set()
        task, self._manager_task = self._manager_task, None
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        http, self._http = self._http, None
        if http is not None:
            await http.stop()
        await self._client.aclose()
