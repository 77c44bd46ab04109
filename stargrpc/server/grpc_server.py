"""The gRPC server: ToolService, health, reflection, and an orderly shutdown.

Health: ToolService and the overall ``""`` service are SERVING once started; a fleet
replica's are NOT_SERVING while its Redis does not answer, and SERVING again when it does
(:mod:`stargrpc.stores.redis.reachability`), so a balancer or a readiness probe sends its
calls elsewhere meanwhile. The name :data:`LIVENESS_SERVICE` is SERVING from the start until
the shutdown, whatever the store does (for liveness probes).

Shutdown (SIGTERM or SIGINT) goes: health flips to NOT_SERVING for good, new Executes are
refused with UNAVAILABLE, runs in flight get the grace period to finish (then are cancelled,
still ending with their Result), and the transport stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from stargrpc.audit.approvals import approval_auditor
from stargrpc.auth.mtls import server_credentials
from stargrpc.contract import SERVICE_NAME
from stargrpc.delivery.audit import delivery_auditor
from stargrpc.errors import CriticConfigError, ToolDefinitionError
from stargrpc.forwarded import ForwardedClient
from stargrpc.gateway.client import MAX_MESSAGE_BYTES
from stargrpc.http_server import HttpEndpoints
from stargrpc.logs import configure_embedded_logging
from stargrpc.mcp import require_mcp_for
from stargrpc.registry import Registry, load_registry
from stargrpc.runs.arguments import ArgumentLimits
from stargrpc.runs.concurrency import ConcurrencyLimits
from stargrpc.runs.permissions import RolePolicy
from stargrpc.runs.runtime import Runtime
from stargrpc.sandbox import log_isolation
from stargrpc.sandbox.pool import WarmPool, start_pool
from stargrpc.sandbox.runner import removals
from stargrpc.server.inprocess import InProcessChannel, InProcessServer
from stargrpc.server.interceptors import build_chain
from stargrpc.server.interceptors.audit import AuditInterceptor
from stargrpc.server.interceptors.auth import AuthInterceptor
from stargrpc.server.interceptors.composed import compose
from stargrpc.server.reflection import enable_reflection
from stargrpc.server.service import ToolService, add_to_server
from stargrpc.server.state_service import SERVICE_NAME as STATE_SERVICE_NAME
from stargrpc.server.state_service import RunStateService
from stargrpc.server.state_service import add_to_server as add_state_service
from stargrpc.settings import Settings
from stargrpc.stores.base import RunStore
from stargrpc.stores.factory import make_store
from stargrpc.stores.sqlite_state import SqliteStateStore
from stargrpc.tracing import TracingRunInterceptor

if TYPE_CHECKING:
    from stargrpc.mcp.server import McpEndpoint
    from stargrpc.mcp.upstream import Upstreams

log = structlog.get_logger("stargrpc.server")

#: The health service name that says only that the process serves: it stays SERVING while
#: the run store is out of reach (until the shutdown), for a liveness probe — restarting a
#: replica does not bring its Redis back.
LIVENESS_SERVICE = "liveness"

# After the runs have drained, how long the transport gets to flush their last messages.
_TRANSPORT_GRACE_SECONDS = 2.0


@runtime_checkable
class Reachable(Protocol):
    """What a run store that can be out of reach (a fleet's Redis) reports of it."""

    reachable: bool

    async def changed(self, seen: bool) -> bool:
        """Waits until ``reachable`` is other than ``seen``; returns it."""
        ...


@runtime_checkable
class Lifecycle(Protocol):
    """A component (typically an interceptor) with work to start and to flush: the server
    starts it before serving and closes it after the last call has ended."""

    async def start(self) -> None:
        """Called once before the server accepts calls."""

    async def aclose(self) -> None:
        """Called once after the server has stopped; flush everything here."""


def load_tools(settings: Settings) -> Registry:
    """The catalog the settings describe.

    Raises:
        ToolDefinitionError: A broken tool module or a duplicate tool name.
    """
    return load_registry(settings.tools_dir, bundled=settings.bundled_tools,
                         entry_points=settings.entry_point_tools)


def build_runtime(settings: Settings, registry: Registry, *,
                  store: RunStore | None = None) -> Runtime:
    """The runtime a server with ``settings`` runs its tools in: its permission policy,
    argument and concurrency limits and run pipeline (supervision always, tracing when on).
    :func:`stargrpc.testing.run_tool` builds its runtime here too, so a test sees what a
    server would do.

    Raises:
        CriticConfigError: The server's critic or a tool's cannot be loaded.
    """
    return Runtime(
        registry,
        store=store,
        state_store=persisted_state(settings),
        limits=ArgumentLimits(settings.max_argument_bytes, settings.max_argument_depth),
        policy=RolePolicy.from_settings(settings),
        settings=settings,
        concurrency=ConcurrencyLimits(
            settings.max_concurrent_runs, settings.max_concurrent_runs_per_principal,
            settings.max_concurrent_runs_per_tool,
            retry_after=settings.limit_retry_after_seconds),
        # The run's span and its steps' (see stargrpc.tracing). Supervision needs no
        # mention: the runtime puts every run under its critic.
        interceptors=[TracingRunInterceptor()] if settings.tracing else (),
    )


def persisted_state(settings: Settings) -> SqliteStateStore | None:
    """The run state store kept across restarts (``state_persist``, embedded only), or None
    for the default: the run store's own (Redis), else memory."""
    if not settings.state_persist or settings.redis_url:
        return None
    return SqliteStateStore(settings.state_dir / "state.db")


class StargrpcServer:
    """One stargrpc server process.

    Attributes:
        settings: The settings it runs with.
        runtime: Runs and catalog.
        port: The bound port, once started.
        warm_pool: Sandboxes started ahead for the sandboxed tools, once started (None
            when it keeps none: see :func:`stargrpc.sandbox.pool.start_pool`).
        inprocess: The services behind the same interceptors, called from this process
            without a channel (the MCP endpoint and the gateway do:
            :mod:`stargrpc.server.inprocess`).
    """

    settings: Settings
    runtime: Runtime
    port: int
    interceptors: list[grpc.aio.ServerInterceptor]
    inprocess: InProcessServer
    http: HttpEndpoints
    mcp: McpEndpoint | None
    upstreams: Upstreams | None
    warm_pool: WarmPool | None
    _local: Registry
    _forwarded: ForwardedClient | None
    _server: grpc.aio.Server
    _health: health.aio.HealthServicer
    _store_health: asyncio.Task[None] | None
    _stopping: asyncio.Event
    _stopped: asyncio.Event

    def __init__(self, settings: Settings, *, registry: Registry | None = None,
                 interceptors: Sequence[grpc.aio.ServerInterceptor] | None = None) -> None:
        self.settings = settings
        # An embedded server honours log_level and log_format as the command does, unless
        # the program embedding it configured logging itself.
        configure_embedded_logging(settings.log_level, settings.log_format)
        require_mcp_for(settings)  # the MCP features need the mcp extra: said first
        # The local tools; the MCP servers of mcp_servers add theirs as they come and go.
        self._local = registry if registry is not None else load_tools(settings)
        self.upstreams = None
        if settings.mcp_servers:
            from stargrpc.mcp.upstream import Upstreams

            self.upstreams = Upstreams(settings, self._upstream_changed)
        self.runtime = build_runtime(settings, self._catalog(self._local),
                                     store=make_store(settings))
        self.interceptors = list(interceptors if interceptors is not None
                                 else build_chain(settings))
        audit = next((i for i in self.interceptors if isinstance(i, AuditInterceptor)), None)
        # The HTTP front ends vouch for their clients' addresses to this audit.
        self._forwarded = audit.forwarded if audit is not None else None
        # The HTTP gateway and the metrics endpoint, each when its port is set.
        self.http = HttpEndpoints(settings, forwarded=self._forwarded)
        self.mcp = None  # the MCP endpoint, when mcp_port is set (started with the server)
        self.warm_pool = None  # sandboxes started ahead, when a sandboxed tool is served
        self.port = 0
        self._stopping = asyncio.Event()
        self._stopped = asyncio.Event()
        # Neighbouring audit, auth and critic stages served as one wrapper per call (same
        # order, same work); self.interceptors keeps each by name.
        served = compose(self.interceptors)
        self._server = grpc.aio.server(interceptors=served, options=self._channel_options())
        # The same handlers behind the same interceptors, for the MCP endpoint and the
        # gateway of this process: their calls skip the loopback channel.
        self.inprocess = InProcessServer(
            served, max_receive_message_bytes=settings.max_receive_message_bytes,
            max_send_message_bytes=settings.max_send_message_bytes)
        registrar = self.inprocess.registrar(self._server)
        self._health = health.aio.HealthServicer()
        self._store_health = None
        self.service = ToolService(self.runtime)
        if audit is not None:  # each delivery's final state goes into the trail
            self.service.deliveries.on_final = delivery_auditor(audit.writer)
            # and each approval request, timeout and withdrawal
            self.runtime.approvals.on_audit = approval_auditor(audit.writer)
            # So does each child run a tool starts (ctx.call): no gRPC call carries it.
            self.runtime.audit_child = audit.audit_child
        self._connect_sessions()
        add_to_server(self.service, registrar)
        add_state_service(RunStateService(self.runtime.state_store, settings), registrar)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, registrar)
        enable_reflection((SERVICE_NAME, STATE_SERVICE_NAME, health.SERVICE_NAME), registrar)

    def _connect_sessions(self) -> None:
        """With a fleet and ``session_advertise_address``: sessions recorded in Redis, and
        calls for a session another replica holds forwarded there."""
        shared = getattr(self.runtime.store, "shared", None)
        address = self.settings.session_advertise_address
        if shared is None or not address:
            return
        from stargrpc.auth.fleet import FleetAssertions
        from stargrpc.sessions.forwarding import (
            SessionDirectory,
            SessionForwarder,
            replica_credentials,
        )

        directory = SessionDirectory(shared.redis, self.settings.redis_key_prefix, address)
        self.service.sessions.directory = directory
        secret = self.settings.fleet_secret
        assertions = (FleetAssertions(secret.get_secret_value(), lambda: directory.address)
                      if secret is not None else None)
        self.service.forwarder = SessionForwarder(
            directory, replica_credentials(self.settings), assertions)
        # The same assertions check the calls other replicas forward here: only with the
        # secret are they accepted at all.
        for interceptor in self.interceptors:
            if isinstance(interceptor, AuthInterceptor):
                interceptor.fleet = assertions
        if assertions is None:
            log.warning("session_forwarding_off", reason="fleet_secret is not set: a call "
                        "for a session another replica holds is refused "
                        "SESSION_FORWARDING_UNCONFIGURED, and no forwarded call is accepted")
        elif self.settings.tls_cert_file is None:
            log.warning("session_forwarding_plaintext", reason="without TLS, a call forwarded "
                        "to the replica holding its session (its arguments, its output) "
                        "crosses the network in plaintext; the caller's credentials never "
                        "do")

    def _channel_options(self) -> list[tuple[str, int]]:
        s = self.settings
        return [
            ("grpc.max_receive_message_length", s.max_receive_message_bytes),
            ("grpc.max_send_message_length", s.max_send_message_bytes),
            # Long streams: ping idle connections so dead peers are noticed, and let
            # clients ping us as often as every 10 s without being cut off.
            ("grpc.keepalive_time_ms", int(s.keepalive_time_seconds * 1000)),
            ("grpc.keepalive_timeout_ms", int(s.keepalive_timeout_seconds * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ("grpc.http2.max_pings_without_data", 0),
        ]

    def _catalog(self, local: Registry) -> Registry:
        """``local`` with the tools of the MCP servers of ``mcp_servers``, if any."""
        return self.upstreams.catalog(local) if self.upstreams is not None else local

    def _upstream_changed(self) -> None:
        self.runtime.replace_registry(self._catalog(self._local))

    def _inprocess_channel(self, name: str) -> InProcessChannel:
        """A channel to this server's services for its own front end ``name`` (its calls'
        peer is ``inproc:<name>``), with the limits of the loopback channel it replaces."""
        return self.inprocess.channel(name, max_send_message_bytes=MAX_MESSAGE_BYTES,
                                      max_receive_message_bytes=MAX_MESSAGE_BYTES)

    async def start(self) -> int:
        """Binds, starts serving and marks every service SERVING.

        Returns:
            The bound port.
        """
        for component in self.interceptors:
            if isinstance(component, Lifecycle):
                await component.start()
        address = f"{self.settings.host}:{self.settings.port}"
        credentials = server_credentials(self.settings)  # TLS (and mTLS) when configured
        self.port = (self._server.add_secure_port(address, credentials) if credentials
                     else self._server.add_insecure_port(address))
        if not self.port:
            raise OSError(f"cannot listen on {address}")
        await self._server.start()
        directory = self.service.sessions.directory
        if directory is not None and directory.address.endswith(":0"):
            # Advertised with port 0: the port this replica bound.
            directory.address = f"{directory.address.rsplit(':', 1)[0]}:{self.port}"
        self.service.deliveries.start()
        self.service.sessions.start()
        if isinstance(self.runtime.store, Lifecycle):  # a fleet's store sweeps for lost runs
            await self.runtime.store.start()
        if self.upstreams is not None:  # in the background: a slow one never delays serving
            self.upstreams.start()
        await self.http.start(self.port, channel=self._inprocess_channel("gateway"))
        if self.settings.mcp_port is not None:
            auth = next((i for i in self.interceptors if isinstance(i, AuthInterceptor)), None)
            audit = next((i for i in self.interceptors if isinstance(i, AuditInterceptor)),
                         None)
            from stargrpc.mcp.server import McpEndpoint

            self.mcp = McpEndpoint(self.settings, self.port,
                                   auth.authenticator if auth is not None else None,
                                   forwarded=self._forwarded,
                                   audit=audit.writer if audit is not None else None,
                                   channel=self._inprocess_channel("mcp"))
            await self.mcp.start()
        await self._health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        reachability = getattr(self.runtime.store, "reachability", None)
        if isinstance(reachability, Reachable):  # a fleet's: SERVING while Redis answers
            reachable = reachability.reachable
            await self._set_health(reachable)
            self._store_health = asyncio.create_task(
                self._follow_store(reachability, reachable), name="run-store-health")
        else:
            await self._set_health(True)
        log.info("serving", address=f"{self.settings.host}:{self.port}",
                 tools=sorted(self.runtime.registry),
                 catalog_hash=self.runtime.registry.catalog_hash)
        sandboxed = sorted(spec.name for spec in self.runtime.registry.values()
                           if spec.kind == "sandbox")
        if sandboxed:  # says which mode, once, and which tools it disables
            await asyncio.to_thread(log_isolation, self.settings, sandboxed)
            self.warm_pool = await start_pool(self.settings, sandboxed)
        return self.port

    async def stop(self, grace: float | None = None) -> None:
        """Drains and stops; safe to call more than once."""
        if self._stopping.is_set():
            await self._stopped.wait()
            return
        self._stopping.set()
        grace = self.settings.shutdown_grace_seconds if grace is None else grace
        log.info("shutting_down", grace_seconds=grace, runs_in_flight=len(self.runtime.runs))
        deadline = time.monotonic() + grace
        if self._store_health is not None:  # NOT_SERVING from here on, whatever Redis does
            self._store_health.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._store_health
            self._store_health = None
        await self._health.enter_graceful_shutdown()
        await self.runtime.drain(grace)
        # The runs have ended, but their calls may still be on the way to the Result (a
        # slow reader, a Result held for the audit's commit): within the grace, those
        # Results go out before the transport stops.
        for component in self.interceptors:
            if isinstance(component, AuditInterceptor):
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                        await component.executes_ended()
        # After the drain: its runs' calls in sessions have ended (or been cancelled).
        await self.service.sessions.aclose()
        if self.service.forwarder is not None:
            await self.service.forwarder.aclose()
        if self.warm_pool is not None:  # no run is left to take from it
            await self.warm_pool.aclose()
        await removals()  # the folders of the last runs, removed as their Results went out
        if self.upstreams is not None:
            await self.upstreams.aclose()
        # After the drain, so HTTP followers saw every run's Result; before the transport
        # stops, so the gateway's own gRPC calls end cleanly.
        await self.http.stop()
        if self.mcp is not None:
            await self.mcp.stop()
        await self._server.stop(_TRANSPORT_GRACE_SECONDS)
        await self.inprocess.stop()  # after the transport's grace, as its calls got it
        await self.service.deliveries.aclose(grace)
        await self.runtime.store.aclose()
        await self.runtime.aclose()
        if isinstance(self.runtime.state_store, SqliteStateStore):
            self.runtime.state_store.close()
        for component in reversed(self.interceptors):
            if isinstance(component, Lifecycle):
                await component.aclose()
        log.info("stopped")
        self._stopped.set()

    async def _set_health(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", SERVICE_NAME):
            await self._health.set(name, status)

    async def _follow_store(self, reachability: Reachable, seen: bool) -> None:
        """Sets the health status each time the run store's reachability changes from
        ``seen`` (until the shutdown, whose NOT_SERVING is final)."""
        while True:
            seen = await reachability.changed(seen)
            await self._set_health(seen)

    def reload_tools(self) -> None:
        """Reloads the catalog; a broken module keeps the current catalog and is logged."""
        try:
            registry = load_tools(self.settings)
            self.runtime.replace_registry(self._catalog(registry))
        except (ToolDefinitionError, CriticConfigError) as exc:
            log.error("reload_failed", error=str(exc))
            return
        self._local = registry

    async def serve_forever(self) -> None:
        """Starts, handles SIGTERM/SIGINT (stop) and SIGHUP (reload), returns once stopped."""
        loop = asyncio.get_running_loop()
        stop_requested = asyncio.Event()
        # The handlers go in before start(): a SIGTERM that arrives while the server is still
        # starting must drain it, not kill the process with the default action.
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop_requested.set)
        loop.add_signal_handler(signal.SIGHUP, self.reload_tools)
        await self.start()
        tune_garbage_collector()
        await stop_requested.wait()
        await self.stop()


#: Allocations between two collections of the youngest generation, and collections of each
#: generation between two of the next (Python's defaults: 700, 10, 10).
GC_THRESHOLDS = (5_000, 20, 20)


def tune_garbage_collector() -> None:
    """Settles the collector for serving, once everything is loaded.

    Everything alive after start-up (modules, descriptors, the catalog) lives as long as the
    process: ``gc.freeze()`` moves it out of the collector's way, so a full collection does
    not walk it (that walk is the longest pause a serving process would otherwise have).
    Every call allocates many short-lived objects, and with Python's thresholds the young
    generations are collected several times per call; :data:`GC_THRESHOLDS` collects them
    less often, which shortens the tail of call latency (figures in ``bench/README.md``).
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
