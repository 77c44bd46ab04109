"""The MCP server side of stargrpc: MCP requests as calls of a stargrpc server's ToolService.

Every MCP request becomes a gRPC call (through :class:`~stargrpc.gateway.client.GatewayClient`)
that carries the MCP caller's credentials, so authentication, permissions, audit, the
critic, limits and idempotency are exactly those of a gRPC caller. The same bridge serves
the in-process HTTP endpoint (``--mcp-port``, credentials from each HTTP request, calls
on the server's in-process channel) and
``stargrpc mcp-stdio`` (credentials from its API key, against any stargrpc server).

- ``tools/list``: ListTools, the tools the caller may run.
- ``tools/call``: Execute; step events, heartbeats and notices become
  ``notifications/progress`` when the request carried a progress token, log notifications
  otherwise, once the call has run for ``mcp_progress_after_seconds``
  (:mod:`stargrpc.mcp.notifications`); the Result becomes the ``CallToolResult``
  (:func:`~stargrpc.mcp.mapping.call_result`); a cancelled request is CancelRun. A
  2026-07-28 call's ``Mcp-Param-*`` headers are checked against the tool's schema kept
  from an earlier listing (:mod:`stargrpc.mcp.catalog`), not by a listing before every
  call.
- ``resources/read`` of ``stargrpc://runs/<run>/output``: WatchRun with the caller's
  credentials, so a run's whole output is readable by whoever may watch the run (its
  owner, or a watcher role), for as long as it is kept; the template is listed by
  ``resources/templates/list``. Nothing else is a resource: ``resources/list`` is empty.
- ``notifications/tools/list_changed``: WatchCatalog, followed with the credentials of the
  connection (handshake-era clients) or of the ``subscriptions/listen`` request
  (2026-07-28 clients).
- tasks (2025-11-25 and the 2026-07-28 extension) and the ``io.stargrpc/run-events``
  extension: :mod:`stargrpc.mcp.task_requests`, on the same runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import grpc
import mcp_types as types
import structlog
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import NotificationOptions, Server
from mcp.server.models import InitializationOptions
from mcp.shared.exceptions import MCPError
from mcp.shared.inbound import validate_mcp_param_headers
from mcp.shared.subscriptions import (
    SUBSCRIPTION_ID_META_KEY,
    ToolsListChanged,
    event_to_notification,
)
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from starlette.requests import Request

from stargrpc import __version__
from stargrpc.client._files import StreamedFiles
from stargrpc.client.errors import CallError
from stargrpc.errors import reason_name
from stargrpc.gateway.client import GatewayClient, Metadata, StartedRun
from stargrpc.mcp.catalog import PARAM_HEADER_PREFIX, CatalogSchemas
from stargrpc.mcp.mapping import (
    IDEMPOTENCY_META_KEY,
    OUTPUT_URI,
    TASK_SUPPORT,
    ProgressView,
    call_result,
    mcp_tool,
    output_text,
    output_uri,
    protocol_error,
    refusal,
    run_of_output_uri,
)
from stargrpc.mcp.notifications import EventNotifications, event_notifications
from stargrpc.mcp.run_events import RUN_EVENTS_EXTENSION
from stargrpc.mcp.run_events import capability as run_events_capability
from stargrpc.mcp.task_requests import Credentials, TaskRequests
from stargrpc.mcp.tasks import TASKS_EXTENSION
from stargrpc.settings import Settings
from stargrpc.v1 import errors_pb2, events_pb2, tool_service_pb2

log = structlog.get_logger("stargrpc.mcp")

#: How long a cancelled ``tools/call`` waits for its CancelRun to be accepted.
CANCEL_TIMEOUT_SECONDS = 5.0

_LOG_LEVELS = {events_pb2.NOTICE_LEVEL_WARNING: "warning"}

#: The refusal of a run pinned to a catalog hash that is no longer current.
CATALOG_STALE = reason_name(errors_pb2.CATALOG_STALE)

_Started = TypeVar("_Started")


#: ``run_retention_seconds``, ``mcp_task_after_seconds`` and ``mcp_progress_after_seconds``
#: of a bridge that is not told.
DEFAULT_RETENTION_SECONDS = float(Settings.model_fields["run_retention_seconds"].default)
DEFAULT_TASK_AFTER_SECONDS = float(Settings.model_fields["mcp_task_after_seconds"].default)
DEFAULT_PROGRESS_AFTER_SECONDS = float(
    Settings.model_fields["mcp_progress_after_seconds"].default)


class _Server(Server[Any]):
    """The SDK's low-level server announcing ``tools.listChanged`` to handshake-era
    clients (the streamable-HTTP manager asks for the options without arguments), tasks
    (``capabilities.tasks`` in 2025-11-25, the extension from 2026-07-28) and the run-events
    extension (``experimental`` in 2025-11-25, which has no ``extensions``)."""

    def create_initialization_options(
            self, notification_options: NotificationOptions | None = None,
            experimental_capabilities: dict[str, dict[str, Any]] | None = None,
            extensions: dict[str, dict[str, Any]] | None = None) -> InitializationOptions:
        return super().create_initialization_options(
            notification_options or NotificationOptions(tools_changed=True),
            experimental_capabilities, extensions)

    def get_capabilities(self, notification_options: NotificationOptions | None = None,
                         experimental_capabilities: dict[str, dict[str, Any]] | None = None,
                         extensions: dict[str, dict[str, Any]] | None = None, *,
                         protocol_version: str | None = None) -> types.ServerCapabilities:
        capabilities = super().get_capabilities(
            notification_options, experimental_capabilities, extensions,
            protocol_version=protocol_version)
        if protocol_version in MODERN_PROTOCOL_VERSIONS:
            capabilities.extensions = {**(capabilities.extensions or {}),
                                       TASKS_EXTENSION: {},
                                       RUN_EVENTS_EXTENSION: run_events_capability()}
            return capabilities
        capabilities.tasks = types.ServerTasksCapability(
            list=types.TasksListCapability(), cancel=types.TasksCancelCapability(),
            requests=types.ServerTasksRequestsCapability(
                tools=types.TasksToolsCapability(call=types.TasksCallCapability())))
        capabilities.experimental = {**(capabilities.experimental or {}),
                                     RUN_EVENTS_EXTENSION: run_events_capability()}
        return capabilities


class Bridge:
    """An MCP server whose tools are a stargrpc server's.

    Attributes:
        client: The gRPC client of the stargrpc server.
        server: The SDK's MCP server (serve it over any MCP transport).
        tasks: Its tasks (and run events).
    """

    client: GatewayClient
    server: Server[Any]
    tasks: TaskRequests
    _credentials: Credentials
    # The tools' schemas as of the latest ListTools (the same for every caller: only
    # permissions differ between their catalogs).
    _catalog: CatalogSchemas
    # How a request shows its run's events (held for mcp_progress_after_seconds).
    _notifications: Callable[[ServerRequestContext[Any, Any]], EventNotifications]

    def __init__(self, client: GatewayClient, credentials: Credentials, *,
                 retention_seconds: float = DEFAULT_RETENTION_SECONDS,
                 task_after_seconds: float = DEFAULT_TASK_AFTER_SECONDS,
                 progress_after_seconds: float = DEFAULT_PROGRESS_AFTER_SECONDS) -> None:
        """A bridge to the server ``client`` calls.

        Args:
            client: The gRPC client of the server.
            credentials: The credentials of the MCP caller behind each request.
            retention_seconds: The server's ``run_retention_seconds`` (tasks' TTL).
            task_after_seconds: ``mcp_task_after_seconds``: how long a 2026-07-28 call of a
                client that takes tasks may run before it is answered with a task.
            progress_after_seconds: ``mcp_progress_after_seconds``: how long a call runs
                before its events are shown (progress or log notifications).
        """
        self.client = client
        self._credentials = credentials
        self._catalog = CatalogSchemas()
        self._notifications = functools.partial(event_notifications,
                                                after=progress_after_seconds)
        self.server = _Server(
            "stargrpc", version=__version__,
            instructions="stargrpc tools: every call is authenticated, audited and supervised.",
            on_list_tools=self._list_tools, on_call_tool=self._call_tool,
            on_list_resources=self._list_resources,
            on_list_resource_templates=self._list_resource_templates,
            on_read_resource=self._read_resource,
            on_subscriptions_listen=self._listen,
            # Never found: the SDK then skips its own Mcp-Param-* check, which would run
            # the whole tools/list before every call; the bridge checks them itself
            # (_param_headers), listing only when it has to.
            get_tool_input_schema=_unknown_tool)
        self.server.add_notification_handler(
            "notifications/initialized", types.NotificationParams, self._initialized)
        self.tasks = TaskRequests(client, credentials, retention_seconds=retention_seconds,
                                  task_after_seconds=task_after_seconds,
                                  declares_output_schema=self._declares_output_schema,
                                  notifications=self._notifications)
        self.tasks.install(self.server)

    # -- tools/list ------------------------------------------------------------------------

    async def _list_tools(self, ctx: ServerRequestContext[Any, Any],
                          params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
        try:
            reply = await self.client.list_tools(self._credentials(ctx))
        except grpc.aio.AioRpcError as error:
            raise protocol_error(CallError.from_rpc_error(error)) from None
        return types.ListToolsResult(tools=self._advertised(reply))

    def _advertised(self, reply: tool_service_pb2.ListToolsResponse) -> list[types.Tool]:
        """The tools of a ListTools reply as its caller is advertised them (those it may
        call); their schemas are kept for later calls."""
        tools = [mcp_tool(tool) for tool in reply.tools]
        for tool in tools:  # every run is a task (the field is of 2025-11-25 only)
            tool.execution = TASK_SUPPORT
        self._catalog.learn(reply, tools)
        return [tool for tool, listed in zip(tools, reply.tools, strict=True)
                if listed.permissions.callable]

    async def _declares_output_schema(self, tool_name: str, metadata: Metadata) -> bool:
        """Whether ``tool_name`` lists an output schema (a ListTools when it is not known
        yet: a client may call a tool without listing first)."""
        known = self._catalog.declares_output_schema(tool_name)
        if known is None:
            try:
                self._advertised(await self.client.list_tools(metadata))
            except grpc.aio.AioRpcError:
                return False
            known = self._catalog.declares_output_schema(tool_name)
        return bool(known)

    async def _param_headers(self, ctx: ServerRequestContext[Any, Any],
                             params: types.CallToolRequestParams, metadata: Metadata, *,
                             exact: bool = False) -> str:
        """Checks a 2026-07-28 ``tools/call``'s ``Mcp-Param-*`` headers against the tool's
        ``x-mcp-header`` annotations as the SDK would (:mod:`stargrpc.mcp.catalog`).

        Returns:
            The catalog hash to pin the run to, when the check relied on the schemas kept
            from an earlier listing ("" when it did not: nothing to check, or ``exact``).

        Raises:
            MCPError: A header does not match its argument (HEADER_MISMATCH).
        """
        request = ctx.request
        if ctx.protocol_version not in MODERN_PROTOCOL_VERSIONS or not isinstance(
                request, Request):
            return ""  # the check is the 2026-07-28 streamable-HTTP transport's
        arguments = params.arguments or {}
        if not arguments and not any(name.startswith(PARAM_HEADER_PREFIX)
                                     for name in request.headers):
            return ""  # no argument and no header: nothing can disagree
        if not exact and self._catalog.without_param_headers(params.name):
            return self._catalog.catalog_hash
        try:  # the SDK's way: the tool as this caller's listing advertises it
            listed = self._advertised(await self.client.list_tools(metadata))
        except grpc.aio.AioRpcError:
            return ""  # as the SDK: a failed listing skips the check, the call answers
        schema = next((tool.input_schema for tool in listed if tool.name == params.name), None)
        if schema is not None:
            rejection = validate_mcp_param_headers(schema, arguments, request.headers)
            if rejection is not None:
                raise MCPError(rejection.code, rejection.message, rejection.data)
        return ""

    async def _start_pinned(self, ctx: ServerRequestContext[Any, Any],
                            params: types.CallToolRequestParams, metadata: Metadata,
                            pin: str, start: Callable[[str], Awaitable[_Started]]
                            ) -> _Started:
        """``start(pin)``; when the catalog changed since the pinned hash (CATALOG_STALE,
        before any run started), the headers are checked again against this caller's
        listing and the run started unpinned.

        Raises:
            grpc.aio.AioRpcError: The call was refused.
            MCPError: A header does not match the changed tool's annotations.
        """
        try:
            return await start(pin)
        except grpc.aio.AioRpcError as error:
            if not pin or CallError.from_rpc_error(error).reason != CATALOG_STALE:
                raise
        log.info("mcp_catalog_changed", tool=params.name)
        await self._param_headers(ctx, params, metadata, exact=True)
        return await start("")

    # -- tools/call ------------------------------------------------------------------------

    async def _call_tool(self, ctx: ServerRequestContext[Any, Any],
                         params: types.CallToolRequestParams) -> types.CallToolResult:
        metadata = self._credentials(ctx)
        pin = await self._param_headers(ctx, params, metadata)
        if ctx.protocol_version in MODERN_PROTOCOL_VERSIONS and self.tasks.declares_tasks(ctx):

            async def start_task() -> str:
                return await self._start_pinned(
                    ctx, params, metadata, pin,
                    lambda pinned: self.tasks.start(params, metadata, catalog_hash=pinned))

            # A CreateTaskResult (resultType "task") is the extension's, past the SDK's sieve.
            return await self.tasks.call_or_task(  # type: ignore[return-value]
                ctx, params, metadata, start=start_task)
        meta = params.meta or {}
        key = meta.get(IDEMPOTENCY_META_KEY, "")
        if not isinstance(key, str):
            raise MCPError(types.INVALID_PARAMS, f"_meta[{IDEMPOTENCY_META_KEY!r}] must be a "
                           "string")
        arguments_json = json.dumps(params.arguments or {})

        async def execute(pinned: str) -> StartedRun:
            request = tool_service_pb2.ExecuteRequest(
                tool_name=params.name, arguments_json=arguments_json, idempotency_key=key,
                catalog_hash=pinned)
            return await self.client.start_run(request, metadata, listen=True)

        try:
            started = await self._start_pinned(ctx, params, metadata, pin, execute)
        except grpc.aio.AioRpcError as error:
            return refusal(CallError.from_rpc_error(error), params.name)
        try:
            final, view = await self._follow(ctx, started)
        except anyio.get_cancelled_exc_class():
            # notifications/cancelled (or the client went away): the run stops too.
            with anyio.CancelScope(shield=True), contextlib.suppress(
                    grpc.aio.AioRpcError, TimeoutError):
                await asyncio.wait_for(
                    self.client.cancel(started.run_id, "the MCP client cancelled the call",
                                       metadata), CANCEL_TIMEOUT_SECONDS)
            raise
        declared = (final.result.HasField("structured_output")
                    and await self._declares_output_schema(params.name, metadata))
        return call_result(final, view, declares_output_schema=declared)

    async def _follow(self, ctx: ServerRequestContext[Any, Any], started: StartedRun
                      ) -> tuple[events_pb2.RunEvent, ProgressView]:
        """Shows the run's events as they come; its final event and what it streamed."""
        assert started.events is not None
        view = ProgressView()
        event: events_pb2.RunEvent | None = started.first
        async with self._notifications(ctx) as notifications:
            while event is not None:
                if event.HasField("result"):
                    return event, view
                text = view.message(event)
                if text is not None:
                    level = (_LOG_LEVELS.get(event.notice.level, "info")
                             if event.HasField("notice") else "info")
                    await notifications.show(event, text, level)
                event = await started.events.get()
        try:
            final = await started.result
        except (grpc.aio.AioRpcError, RuntimeError) as exc:
            raise MCPError(types.INTERNAL_ERROR, f"lost the stream of run {started.run_id} "
                           f"({exc}); it may still be going",
                           {"run_id": started.run_id}) from None
        return final, view

    # -- resources: the whole output of a run ------------------------------------------------

    async def _list_resources(self, ctx: ServerRequestContext[Any, Any],
                              params: types.PaginatedRequestParams | None
                              ) -> types.ListResourcesResult:
        return types.ListResourcesResult(resources=[])

    async def _list_resource_templates(self, ctx: ServerRequestContext[Any, Any],
                                       params: types.PaginatedRequestParams | None
                                       ) -> types.ListResourceTemplatesResult:
        return types.ListResourceTemplatesResult(resource_templates=[types.ResourceTemplate(
            uri_template=OUTPUT_URI.replace("{run_id}", "{run}"), name="run-output",
            title="The whole output of a run", mime_type="text/plain",
            description="All of a run's output text, which a tool result longer than the "
            "text it shows links to. Readable by whoever may watch the run, while it is "
            "kept.")])

    async def _read_resource(self, ctx: ServerRequestContext[Any, Any],
                             params: types.ReadResourceRequestParams
                             ) -> types.ReadResourceResult:
        """The whole output of a run, replayed with WatchRun (waiting for its end)."""
        uri = str(params.uri)
        run_id = run_of_output_uri(uri)
        if run_id is None:
            raise MCPError(types.INVALID_PARAMS, f"Unknown resource: {uri}", {"uri": uri})
        chunks = StreamedFiles()
        call = self.client.watch(run_id, 0, self._credentials(ctx))
        try:
            while (reply := await call.read()) is not grpc.aio.EOF:
                event = reply.event
                if event.HasField("file_chunk"):
                    chunks.add(event.file_chunk.file_id, event.file_chunk.offset,
                               event.file_chunk.data)
                elif event.HasField("result"):
                    text = output_text(event.result, run_id, chunks)
                    return types.ReadResourceResult(contents=[types.TextResourceContents(
                        uri=output_uri(run_id), mime_type="text/plain", text=text)])
        except grpc.aio.AioRpcError as error:
            refused = CallError.from_rpc_error(error)
            if refused.code is grpc.StatusCode.NOT_FOUND:
                # An unknown, expired or another caller's run: the same answer for each.
                raise MCPError(types.INVALID_PARAMS, f"Unknown resource: {uri}",
                               {"uri": uri, "reason": refused.reason or "RUN_NOT_FOUND"}
                               ) from None
            raise protocol_error(refused) from None
        finally:
            call.cancel()
        raise MCPError(types.INTERNAL_ERROR, f"the stream of run {run_id} ended before its "
                       "Result; read the resource again", {"uri": uri})

    # -- notifications/tools/list_changed ----------------------------------------------------

    async def _initialized(self, ctx: ServerRequestContext[Any, Any],
                           params: types.NotificationParams) -> None:
        """Handshake era: the connection's standalone channel hears of each catalog change
        for as long as the connection lasts (this handler runs in its task group)."""
        if ctx.protocol_version in MODERN_PROTOCOL_VERSIONS:
            return
        metadata = self._credentials(ctx)
        with contextlib.suppress(MCPError):
            await self._follow_catalog(metadata, None, ctx.session.send_tool_list_changed)

    async def _listen(self, ctx: ServerRequestContext[Any, Any],
                      params: types.SubscriptionsListenRequestParams
                      ) -> types.SubscriptionsListenResult:
        """2026-07-28: one ``subscriptions/listen`` stream, acknowledged once WatchCatalog
        has accepted the caller's credentials."""
        subscription_id = ctx.request_id
        if subscription_id is None:
            raise MCPError(types.INVALID_REQUEST, "subscriptions/listen requires a request id")
        wanted = bool(params.notifications.tools_list_changed)
        meta: dict[str, Any] = {SUBSCRIPTION_ID_META_KEY: subscription_id}

        async def acknowledge() -> None:
            honored = types.SubscriptionFilter(tools_list_changed=True if wanted else None)
            await ctx.session.send_notification(
                types.SubscriptionsAcknowledgedNotification(
                    params=types.SubscriptionsAcknowledgedNotificationParams(
                        notifications=honored, _meta=meta)),
                related_request_id=subscription_id)

        async def changed() -> None:
            if wanted:
                await ctx.session.send_notification(
                    event_to_notification(ToolsListChanged(), meta),
                    related_request_id=subscription_id)

        await self._follow_catalog(self._credentials(ctx), acknowledge, changed)
        return types.SubscriptionsListenResult(_meta=meta)

    async def _follow_catalog(self, metadata: Metadata,
                              on_start: Callable[[], Awaitable[None]] | None,
                              on_change: Callable[[], Awaitable[None]]) -> None:
        """Reads WatchCatalog until it ends; ``on_change`` after each new catalog hash.

        Raises:
            MCPError: WatchCatalog was refused (before ``on_start``).
        """
        call = self.client.stub.WatchCatalog(tool_service_pb2.WatchCatalogRequest(),
                                             metadata=metadata)
        try:
            first = await call.read()
            if first is grpc.aio.EOF:
                return
            if on_start is not None:
                await on_start()
            known = first.catalog_hash
            while (reply := await call.read()) is not grpc.aio.EOF:
                if reply.catalog_hash != known:
                    known = reply.catalog_hash
                    await on_change()
        except grpc.aio.AioRpcError as error:
            if error.code() is grpc.StatusCode.CANCELLED:
                return  # the server is shutting down
            refused = CallError.from_rpc_error(error)
            log.info("mcp_catalog_watch_ended", code=refused.code.name, reason=refused.reason)
            raise protocol_error(refused) from None
        finally:
            call.cancel()


def _unknown_tool(tool_name: str) -> None:
    """The SDK's ``get_tool_input_schema``: no schema, so it checks no header itself."""
    return None
