"""Serving ASGI apps (the HTTP gateway, the metrics endpoint) inside the server process.

Both run on uvicorn in the server's own event loop. The socket is bound and listening before
uvicorn gets it, so port 0 works without a bind-release race and a client may connect as
soon as :meth:`AsgiServer.start` returns. Under ``serve --workers N`` every worker process
serves each HTTP port through ``SO_REUSEPORT``, as it does the gRPC port. uvicorn's own
``serve()`` is not used: it would take over SIGTERM/SIGINT, which belong to
:class:`~stargrpc.server.StargrpcServer`.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Sequence
from typing import Any

import grpc
import h11
import structlog
import uvicorn
from cryptography import x509
from cryptography.x509.oid import NameOID
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from stargrpc.forwarded import ForwardedClient
from stargrpc.gateway import Gateway
from stargrpc.metrics import scrape_registry
from stargrpc.settings import Settings

log = structlog.get_logger("stargrpc.http")

#: Seconds between two log lines of requests refused for ``http_max_connections``.
CONNECTIONS_FULL_LOG_SECONDS = 60.0


class _ConnectionsFullOnce(logging.Filter):
    """Lets uvicorn's warning of a request refused 503 for ``http_max_connections``
    ("Exceeded concurrency limit.") through at most once a minute, saying how many were
    refused since the last one: a flood of requests must not become a flood of log lines."""

    def __init__(self) -> None:
        super().__init__()
        self._last = -CONNECTIONS_FULL_LOG_SECONDS
        self._refused = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage() != "Exceeded concurrency limit.":
            return True
        self._refused += 1
        now = time.monotonic()
        if now - self._last < CONNECTIONS_FULL_LOG_SECONDS:
            return False
        self._last = now
        record.msg = ("%d request(s) answered 503: as many connections open (or requests in "
                      "progress) as http_max_connections allows")
        record.args = (self._refused,)
        self._refused = 0
        return True


_CONNECTIONS_FULL = _ConnectionsFullOnce()

#: How long open HTTP connections get to finish once an HTTP server stops.
HTTP_SHUTDOWN_GRACE_SECONDS = 3

#: How long a client has to send a request's head (its request line and headers) once the
#: connection is ready for it: a client that never finishes it is cut off.
REQUEST_HEAD_SECONDS = 10.0

#: How long a client has to send a request's body once its head is in.
REQUEST_BODY_SECONDS = 60.0


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, with a deadline on each request the client sends.

    uvicorn itself waits for ever for a request that does not come whole: a connection
    opened and left silent, a head sent a byte at a time, a body announced and never
    finished each held a socket (and, for a body, what had arrived of it) with no
    credentials asked, so that anyone who reached the port could hold as many as it
    liked. Here the head must be in within :data:`REQUEST_HEAD_SECONDS` of the connection
    (or of the previous response, on a kept-alive one), the body within
    :data:`REQUEST_BODY_SECONDS` of the head; a client that is late is disconnected. The
    response is not timed: an event stream may last as long as its run.
    """

    _read_deadline: asyncio.TimerHandle | None = None
    _read_deadline_state: object = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._time_the_request()

    def connection_lost(self, exc: Exception | None) -> None:
        self._clear_read_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._time_the_request()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._time_the_request()

    def _time_the_request(self) -> None:
        """Arms the deadline of what the client owes now: the head, the body, or nothing."""
        state = self.conn.their_state
        owed = {h11.IDLE: REQUEST_HEAD_SECONDS, h11.SEND_BODY: REQUEST_BODY_SECONDS}.get(state)
        if owed is None or self.transport.is_closing():
            self._clear_read_deadline()
            return
        if self._read_deadline is not None and self._read_deadline_state is state:
            return  # still owing the same part: its deadline stands
        self._clear_read_deadline()
        self._read_deadline_state = state
        self._read_deadline = self.loop.call_later(owed, self._read_too_late, state)

    def _clear_read_deadline(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _read_too_late(self, state: object) -> None:
        self._read_deadline = None
        if self.conn.their_state is not state or self.transport.is_closing():
            return
        log.info("http_request_too_slow", part="head" if state is h11.IDLE else "body",
                 client=self.client[0] if self.client else None)
        self.transport.close()


def metrics_app(registry: CollectorRegistry | None = None) -> Starlette:
    """The Prometheus scrape endpoint: an ASGI app serving ``registry`` (default
    :func:`~stargrpc.metrics.scrape_registry`, under ``--workers`` the sum over the worker
    processes) at ``/metrics``, in the text format or OpenMetrics when the scraper asks for
    it; everything else is 404. It gets a port of its own (``serve --metrics-port``), not
    the gateway's, so that operators can keep it off the public network."""
    if registry is None:
        registry = scrape_registry()

    async def scrape(request: Request) -> Response:
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encoder(registry), media_type=content_type,
                        headers={"Cache-Control": "no-store"})

    return Starlette(routes=[Route("/metrics", scrape, methods=["GET"])])


def _bind(host: str, port: int, reuse_port: bool) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, not left 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only
    # on connections whose socket says it is TCP, and accepted sockets inherit this one's
    # protocol. Without it every response after the first on a kept-alive connection
    # waited for the client's delayed ACK (~40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class AsgiServer:
    """One ASGI app served by uvicorn on one address, in the running event loop.

    Attributes:
        name: What it serves, for the logs.
        port: The bound port, once started.
        reuse_port: Share the port with the other worker processes (``SO_REUSEPORT``).
    """

    name: str
    port: int
    reuse_port: bool
    _app: Any
    _host: str
    _trusted_proxies: list[str]
    _requested_port: int
    _server: uvicorn.Server | None
    _socket: socket.socket | None
    _max_connections: int | None

    def __init__(self, name: str, app: Any, host: str, port: int, *,
                 reuse_port: bool = False, trusted_proxies: Sequence[str] = (),
                 max_connections: int | None = None) -> None:
        """``app`` served on ``host:port``; the X-Forwarded-For of ``trusted_proxies``
        (addresses or networks) names the client, nobody else's. With ``max_connections``,
        a request arriving while that many connections are open (or that many requests in
        progress) is answered 503 (``http_max_connections``)."""
        self.name = name
        self._max_connections = max_connections
        self._trusted_proxies = list(trusted_proxies)
        self.port = 0
        self.reuse_port = reuse_port
        self._app = app
        self._host = host
        self._requested_port = port
        self._server = None
        self._socket = None

    async def start(self) -> int:
        """Binds and starts serving.

        Returns:
            The bound port.

        Raises:
            OSError: The address cannot be bound.
        """
        if self._max_connections is not None:
            logging.getLogger("uvicorn.error").addFilter(_CONNECTIONS_FULL)  # (idempotent)
        self._socket = _bind(self._host, self._requested_port, self.reuse_port)
        self.port = self._socket.getsockname()[1]
        config = uvicorn.Config(
            self._app, lifespan="off", log_config=None, access_log=False,
            timeout_graceful_shutdown=HTTP_SHUTDOWN_GRACE_SECONDS,
            # The event loop is the server's; uvicorn must not install another.
            loop="none", http=DeadlineH11Protocol, ws="none",
            # uvicorn believes 127.0.0.1 by default: any local process could then name
            # any client to the audit (stargrpc.forwarded).
            proxy_headers=bool(self._trusted_proxies),
            forwarded_allow_ips=self._trusted_proxies,
            # uvicorn counts the connection a request came on among those open: one more,
            # so that max_connections connections are served at once.
            limit_concurrency=(self._max_connections + 1 if self._max_connections is not None
                               else None),
        )
        config.load()
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)
        await server.startup(sockets=[self._socket])
        self._server = server
        log.info("http_serving", what=self.name, address=f"{self._host}:{self.port}")
        return self.port

    async def stop(self) -> None:
        """Stops accepting, lets open requests finish briefly, then closes; idempotent."""
        server, self._server = self._server, None
        if server is None:
            return
        server.should_exit = True
        await server.shutdown(sockets=[self._socket] if self._socket else None)
        self._socket = None


def grpc_target(settings: Settings, port: int) -> str:
    """The loopback address at which this process's gRPC server is reached."""
    host = settings.host
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def gateway_tls(settings: Settings) -> tuple[grpc.ChannelCredentials | None, str | None]:
    """How the gateway reaches a server that serves TLS: the roots it trusts and the name
    it expects in the certificate; (None, None) for plaintext.

    Raises:
        OSError: A certificate file cannot be read.
    """
    if settings.tls_cert_file is None:
        return None, None
    served = settings.tls_cert_file.read_bytes()
    roots = (settings.http_grpc_ca_file.read_bytes() if settings.http_grpc_ca_file
             else served)
    return (grpc.ssl_channel_credentials(root_certificates=roots),
            settings.http_grpc_server_name or certificate_name(served))


def certificate_name(pem: bytes) -> str | None:
    """The first DNS name of a PEM certificate, else its common name."""
    cert = x509.load_pem_x509_certificate(pem)
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        dns = names.get_values_for_type(x509.DNSName)
        if dns:
            return str(dns[0])
    except x509.ExtensionNotFound:
        pass
    common = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(common[0].value) if common else None


class HttpEndpoints:
    """The HTTP side of a server: the gateway (``http_port``) and the metrics endpoint
    (``metrics_port``), each only when its port is set.

    Attributes:
        gateway: The gateway, when enabled.
        gateway_port: Its bound port, once started (0 when off).
        metrics_port: The metrics endpoint's bound port, once started (0 when off).
    """

    gateway: Gateway | None
    _settings: Settings
    _forwarded: ForwardedClient | None
    _servers: list[AsgiServer]

    def __init__(self, settings: Settings, *, forwarded: ForwardedClient | None = None) -> None:
        """The endpoints ``settings`` ask for; ``forwarded`` vouches for each HTTP client's
        address to the server's audit (:mod:`stargrpc.forwarded`)."""
        self._settings = settings
        self._forwarded = forwarded
        self.gateway = None
        self._servers = []
        self.gateway_port = 0
        self.metrics_port = 0

    async def start(self, grpc_port: int, *, channel: grpc.aio.Channel | None = None) -> None:
        """Starts what is enabled; ``grpc_port`` is where the gateway's calls go, unless
        ``channel`` (an in-process channel to the same server) is given.

        Raises:
            OSError: A port cannot be bound (whatever had started is stopped again).
        """
        s = self._settings
        try:
            if s.metrics_port is not None:
                metrics = AsgiServer("metrics", metrics_app(), s.metrics_host or s.host,
                                     s.metrics_port, reuse_port=s.workers > 1,
                                     max_connections=s.http_max_connections)
                self._servers.append(metrics)
                self.metrics_port = await metrics.start()
            if s.http_port is not None:
                # In-process, the channel has no transport to secure: no certificate read.
                credentials, server_name = (gateway_tls(s) if channel is None
                                            else (None, None))
                self.gateway = Gateway(grpc_target(s, grpc_port), credentials=credentials,
                                       server_name=server_name,
                                       max_body_bytes=s.max_receive_message_bytes,
                                       allowed_hosts=s.http_allowed_hosts,
                                       allowed_origins=s.http_allowed_origins,
                                       forwarded=self._forwarded, channel=channel)
                await self.gateway.start()
                web = AsgiServer("gateway", self.gateway.app, s.http_host or s.host,
                                 s.http_port, reuse_port=s.workers > 1,
                                 trusted_proxies=s.http_trusted_proxies,
                                 max_connections=s.http_max_connections)
                self._servers.append(web)
                self.gateway_port = await web.start()
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        """Ends the gateway's streams, then stops the HTTP servers; idempotent."""
        if self.gateway is not None:
            await self.gateway.aclose()
        for server in reversed(self._servers):
            await server.stop()
        self._servers = []
