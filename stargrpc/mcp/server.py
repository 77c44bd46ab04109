"""The MCP endpoint of a server process: streamable HTTP at ``/mcp`` on ``mcp_port``.

It is a :class:`~stargrpc.mcp.bridge.Bridge` on the server's in-process channel to its own
ToolService (:mod:`stargrpc.server.inprocess`: the same handlers behind the same
interceptors, without a loopback connection); each MCP request's ``Authorization`` header
(with the trace context) is forwarded as the gRPC call's credentials. Before the SDK's
session manager sees a request, :class:`~stargrpc.mcp.sessions.SessionGuard` authenticates
it with the server's authenticator, so a session is only ever opened for, and used by, one
principal.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from typing import Any

import grpc
import structlog
from mcp.server.transport_security import TransportSecuritySettings
from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp

from stargrpc.audit.writer import AuditWriter
from stargrpc.auth.authenticator import Authenticator
from stargrpc.forwarded import ForwardedClient
from stargrpc.gateway.app import call_metadata
from stargrpc.gateway.client import GatewayClient, Metadata
from stargrpc.http_guard import RequestGuard
from stargrpc.http_server import AsgiServer, gateway_tls, grpc_target
from stargrpc.mcp.bridge import Bridge
from stargrpc.mcp.sessions import SessionGuard, Sessions
from stargrpc.settings import Settings

log = structlog.get_logger("stargrpc.mcp")


class _ClientWentAway(logging.Filter):
    """A client that hung up in the middle of its request is its own doing, not a fault of
    the server: the MCP SDK logs it as an error with a whole traceback, which any caller
    holding a key could repeat to flood the log. It becomes one line at INFO."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], ClientDisconnect):
            record.msg, record.args = f"{record.getMessage()}: the client went away", ()
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


_CLIENT_WENT_AWAY = _ClientWentAway()

#: The path of the endpoint.
MCP_PATH = "/mcp"


def request_credentials(ctx: Any, forwarded: ForwardedClient | None = None) -> Metadata:
    """The gRPC metadata of the HTTP request behind an MCP request (none on other
    transports); ``forwarded`` vouches for the HTTP client's address to the audit."""
    request = ctx.request
    return call_metadata(request, forwarded) if isinstance(request, Request) else []


class McpEndpoint:
    """The streamable-HTTP MCP endpoint of one server.

    Attributes:
        port: The bound port, once started.
        sessions: The open MCP sessions, by principal.
    """

    port: int
    sessions: Sessions
    _settings: Settings
    _authenticator: Authenticator
    _audit: AuditWriter | None
    _client: GatewayClient
    _bridge: Bridge
    _http: AsgiServer | None
    _manager_task: asyncio.Task[None] | None
    _manager_stop: asyncio.Event

    def __init__(self, settings: Settings, grpc_port: int,
                 authenticator: Authenticator | None = None, *,
                 forwarded: ForwardedClient | None = None,
                 audit: AuditWriter | None = None,
                 channel: grpc.aio.Channel | None = None) -> None:
        """The endpoint of the server whose gRPC port is ``grpc_port``.

        Args:
            settings: The server's settings.
            grpc_port: The server's gRPC port.
            authenticator: The one the server's gRPC calls are authenticated with (made
                from ``settings`` when not given): it names the principal who owns each
                MCP session.
            forwarded: Vouches for each HTTP client's address to the server's audit
                (:mod:`stargrpc.forwarded`).
            audit: The server's audit writer: a request refused for its credentials before
                it reaches the gRPC server is recorded there.
            channel: The server's in-process channel (:mod:`stargrpc.server.inprocess`):
                the bridge's calls go through it instead of the loopback network.

        Raises:
            OSError: With TLS on and no ``channel``, a certificate file cannot be read.
            AuthConfigError: A JWT key is unusable.
        """
        self._settings = settings
        self._audit = audit
        self._authenticator = (authenticator if authenticator is not None
                               else Authenticator(settings))
        self.sessions = Sessions(settings.mcp_max_sessions_per_principal,
                                 settings.mcp_session_idle_seconds)
        # In-process, the channel has no transport to secure: no certificate is read.
        credentials, server_name = gateway_tls(settings) if channel is None else (None, None)
        self._client = GatewayClient(grpc_target(settings, grpc_port), credentials=credentials,
                                     server_name=server_name, channel=channel)
        self._bridge = Bridge(self._client,
                              functools.partial(request_credentials, forwarded=forwarded),
                              retention_seconds=settings.run_retention_seconds,
                              task_after_seconds=settings.mcp_task_after_seconds,
                              progress_after_seconds=settings.mcp_progress_after_seconds)
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
        # On the SDK's logger itself, so every handler (a test's too) sees the one line.
        logging.getLogger("mcp.server.streamable_http").addFilter(_CLIENT_WENT_AWAY)
        try:
            return await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> int:
        s = self._settings
        host = s.mcp_host or s.host
        await self._client.start()
        app: ASGIApp = SessionGuard(self._bridge.server.streamable_http_app(
            streamable_http_path=MCP_PATH, host=host,
            max_request_body_size=s.max_receive_message_bytes,
            max_sessions=s.mcp_max_sessions, session_idle_timeout=s.mcp_session_idle_seconds,
            # Host and Origin are the guard's, as on the gateway: the SDK's own check knows
            # only loopback names, and only when bound to loopback.
            transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False),
        ), self._authenticator, self.sessions, audit=self._audit)
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
                                trusted_proxies=s.http_trusted_proxies,
                                max_connections=s.http_max_connections)
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
        self.sessions.clear()
        await self._bridge.tasks.aclose()
        http, self._http = self._http, None
        if http is not None:
            await http.stop()
        await self._client.aclose()
