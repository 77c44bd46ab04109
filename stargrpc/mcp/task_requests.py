"""The MCP requests of tasks (see :mod:`stargrpc.mcp.tasks` for what a task is) and of the
``io.stargrpc/run-events`` extension (:mod:`stargrpc.mcp.run_events`).

- 2025-11-25: a ``tools/call`` with ``task`` starts the run detached (StartRun) and answers
  ``CreateTaskResult`` at once; the SDK's sieve knows no such answer to ``tools/call`` in
  that version, so it is served by a server middleware ahead of it. ``tasks/get``,
  ``tasks/result``, ``tasks/list``, ``tasks/cancel``; ``notifications/tasks/status`` (and
  the task's progress, when the call asked for it) on the session's standalone stream.
- 2026-07-28: a ``tools/call`` whose request declares ``io.modelcontextprotocol/tasks``
  starts the run detached and follows it for ``mcp_task_after_seconds``: ended by then,
  the answer is its ``CallToolResult``; else a task (``resultType: "task"``). ``tasks/get``
  (result inline) and ``tasks/cancel``; both refuse a request that does not declare the
  extension (-32021), as SEP-2663 requires. ``tasks/update`` is acknowledged (no run asks
  its client for input).

Every task-created run carries an idempotency key (the caller's, else a fresh one): the
server then registers the run in its store before StartRun answers, so the task can be
read on any replica as soon as its id is known.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio
import grpc
import mcp_types as types
import structlog
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.shared.exceptions import MCPError
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from pydantic import ValidationError

from stargrpc.client.errors import CallError
from stargrpc.gateway.client import GatewayClient, Metadata
from stargrpc.ids import minted_ms, new_id
from stargrpc.mcp.mapping import (
    IDEMPOTENCY_META_KEY,
    UNAUTHENTICATED,
    ProgressView,
    call_result,
    refusal,
)
from stargrpc.mcp.notifications import EventNotifications
from stargrpc.mcp.run_events import RUN_EVENTS_METHOD, RunEventsParams, read_events
from stargrpc.mcp.tasks import (
    LEGACY_TASKS_VERSION,
    RELATED_TASK_META_KEY,
    TASKS_EXTENSION,
    RunSnapshot,
    TaskIdParams,
    TaskRuns,
    result_meta,
    task_status,
)
from stargrpc.v1 import events_pb2, tool_service_pb2

log = structlog.get_logger("stargrpc.mcp")

#: The credentials (gRPC metadata) of the MCP caller behind a request.
Credentials = Callable[[ServerRequestContext[Any, Any]], Metadata]
#: Whether a tool lists an output schema (by name, with the caller's credentials).
DeclaresOutputSchema = Callable[[str, Metadata], Awaitable[bool]]
#: How one request shows a run's events (progress, or log messages; held at first).
Notifications = Callable[[ServerRequestContext[Any, Any]], EventNotifications]

#: How long ``tasks/cancel`` (2025-11-25) waits for the run to end cancelled.
CANCEL_WAIT_SECONDS = 5.0
#: Tasks whose status one server follows at once to notify their sessions (2025-11-25);
#: more are still served, polled instead.
MAX_FOLLOWED_TASKS = 1000
#: JSON-RPC error of a request that needs a client capability it did not declare.
MISSING_REQUIRED_CLIENT_CAPABILITY = -32021


class TaskRequests:
    """Serves tasks and run events on a Bridge's MCP server."""

    runs: TaskRuns
    _client: GatewayClient
    _credentials: Credentials
    _declares_output_schema: DeclaresOutputSchema
    _notifications: Notifications
    _task_after_seconds: float
    _followers: set[asyncio.Task[None]]

    def __init__(self, client: GatewayClient, credentials: Credentials, *,
                 retention_seconds: float, task_after_seconds: float,
                 declares_output_schema: DeclaresOutputSchema,
                 notifications: Notifications) -> None:
        self.runs = TaskRuns(client, retention_seconds)
        self._client = client
        self._credentials = credentials
        self._declares_output_schema = declares_output_schema
        self._notifications = notifications
        self._task_after_seconds = task_after_seconds
        self._followers = set()

    def install(self, server: Server[Any]) -> None:
        """Registers the task methods, the extension's method and the middleware."""
        server.add_request_handler("tasks/get", TaskIdParams, self._get)
        server.add_request_handler("tasks/result", TaskIdParams, self._result)
        server.add_request_handler("tasks/cancel", TaskIdParams, self._cancel)
        server.add_request_handler("tasks/update", TaskIdParams, self._update)
        server.add_request_handler("tasks/list", types.PaginatedRequestParams, self._list)
        server.add_request_handler(RUN_EVENTS_METHOD, RunEventsParams, self._events)
        server.middleware.append(self._task_augmented_call)

    # -- 2025-11-25: tools/call with `task` --------------------------------------------------

    async def _task_augmented_call(self, ctx: ServerRequestContext[Any, Any],
                                   call_next: CallNext) -> HandlerResult:
        params = ctx.params
        if not (ctx.method == "tools/call" and ctx.protocol_version == LEGACY_TASKS_VERSION
                and isinstance(params, Mapping) and params.get("task") is not None):
            return await call_next(ctx)
        try:
            call = types.CallToolRequestParams.model_validate(params, by_name=False)
        except ValidationError:
            raise MCPError(types.INVALID_PARAMS, "Invalid request parameters",
                           "tools/call params (task: {\"ttl\": milliseconds})") from None
        assert call.task is not None
        if call.task.ttl is not None and call.task.ttl < 0:
            raise MCPError(types.INVALID_PARAMS, "task.ttl must be 0 or more milliseconds",
                           {"ttl": call.task.ttl})
        metadata = self._credentials(ctx)
        try:
            run_id = await self.start(call, metadata)
        except grpc.aio.AioRpcError as error:
            raise _refused(CallError.from_rpc_error(error), call.name) from None
        log.info("mcp_task_created", run_id=run_id, tool=call.name,
                 protocol=LEGACY_TASKS_VERSION)
        now = int(time.time() * 1000)
        seed = RunSnapshot(run_id, call.name, False, minted_ms(run_id) or now, now, "started", 0)
        self._follow(ctx, run_id, metadata)
        return {"task": self.runs.task(seed, legacy=True)}

    async def start(self, call: types.CallToolRequestParams, metadata: Metadata, *,
                    catalog_hash: str = "") -> str:
        """StartRun for a task (with an idempotency key, so the run is in the shared store
        before the answer), pinned to ``catalog_hash`` when given.

        Raises:
            MCPError: INVALID_PARAMS for an idempotency key that is not a string.
            grpc.aio.AioRpcError: The call was refused.
        """
        key = (call.meta or {}).get(IDEMPOTENCY_META_KEY) or f"mcp-task-{new_id()}"
        if not isinstance(key, str):
            raise MCPError(types.INVALID_PARAMS, f"_meta[{IDEMPOTENCY_META_KEY!r}] must be a "
                           "string")
        reply = await self._client.stub.StartRun(tool_service_pb2.StartRunRequest(
            tool_name=call.name, arguments_json=json.dumps(call.arguments or {}),
            idempotency_key=key, catalog_hash=catalog_hash), metadata=metadata)
        return str(reply.run_id)

    def _follow(self, ctx: ServerRequestContext[Any, Any], run_id: str,
                metadata: Metadata) -> None:
        """Tells the session of the task's progress (when the call asked for it) and of its
        end (``notifications/tasks/status``), on its standalone stream, in a task of its own:
        the request has been answered."""
        if len(self._followers) >= MAX_FOLLOWED_TASKS:
            return
        token = (ctx.meta or {}).get("progress_token", (ctx.meta or {}).get("progressToken"))
        session = ctx.session
        related = {RELATED_TASK_META_KEY: {"taskId": run_id}}
        view = ProgressView()

        async def progress(event: events_pb2.RunEvent) -> None:
            text = view.message(event)
            if token is not None and text is not None:
                await session.send_notification(types.ProgressNotification(
                    params=types.ProgressNotificationParams(
                        progress_token=token, progress=float(event.seq), message=text,
                        _meta=related)))

        async def follow() -> None:
            with contextlib.suppress(Exception):  # the session or the server went away
                snapshot = await self.runs.wait_final(run_id, metadata, progress)
                task = self.runs.task(snapshot, legacy=True)
                await session.send_notification(types.TaskStatusNotification(  # type: ignore[arg-type]
                    params=types.TaskStatusNotificationParams.model_validate(task)))

        task = asyncio.create_task(follow(), name=f"mcp-task-{run_id}")
        self._followers.add(task)
        task.add_done_callback(self._followers.discard)

    async def aclose(self) -> None:
        """Stops following tasks."""
        for task in list(self._followers):
            task.cancel()
        if self._followers:
            await asyncio.gather(*self._followers, return_exceptions=True)

    # -- 2026-07-28: the server decides --------------------------------------------------

    @staticmethod
    def declares_tasks(ctx: ServerRequestContext[Any, Any]) -> bool:
        """Whether this request's client declares the tasks extension (2026-07-28: per
        request, in ``_meta``)."""
        caps = (ctx.meta or {}).get(types.CLIENT_CAPABILITIES_META_KEY)
        if isinstance(caps, Mapping):
            extensions = caps.get("extensions")
            return isinstance(extensions, Mapping) and TASKS_EXTENSION in extensions
        declared = ctx.session.client_capabilities
        return bool(declared is not None and declared.extensions
                    and TASKS_EXTENSION in declared.extensions)

    async def call_or_task(self, ctx: ServerRequestContext[Any, Any],
                           params: types.CallToolRequestParams, metadata: Metadata, *,
                           start: Callable[[], Awaitable[str]]
                           ) -> types.CallToolResult | dict[str, Any]:
        """A 2026-07-28 ``tools/call`` of a client that takes tasks: the run's result when it
        ends within ``mcp_task_after_seconds``, else the task (``resultType: "task"``).
        ``start`` starts its run; ``metadata``: the caller's credentials, made once by the
        bridge for the whole call."""
        try:
            run_id = await start()
        except grpc.aio.AioRpcError as error:
            return refusal(CallError.from_rpc_error(error), params.name)
        view = ProgressView()
        notifications = self._notifications(ctx)
        deadline = time.monotonic() + self._task_after_seconds
        call = self._client.watch(run_id, 0, metadata)
        try:
            while (left := deadline - time.monotonic()) > 0:
                try:
                    reply = await asyncio.wait_for(call.read(), left)
                except TimeoutError:
                    break
                if reply is grpc.aio.EOF:
                    break
                event = reply.event
                if event.HasField("result"):
                    declared = (event.result.HasField("structured_output")
                                and await self._declares_output_schema(params.name, metadata))
                    return call_result(event, view, declares_output_schema=declared)
                text = view.message(event)
                if text is not None:
                    await notifications.show(event, text)
        except grpc.aio.AioRpcError as error:
            log.info("mcp_task_watch_failed", run_id=run_id, error=str(error))
        except anyio.get_cancelled_exc_class():
            # notifications/cancelled before the answer: the run stops too.
            with anyio.CancelScope(shield=True), contextlib.suppress(
                    grpc.aio.AioRpcError, TimeoutError, MCPError):
                await asyncio.wait_for(self.runs.cancel(run_id, metadata),
                                       CANCEL_WAIT_SECONDS)
            raise
        finally:
            call.cancel()
            await notifications.close()
        snapshot = await self.runs.snapshot(run_id, metadata)
        if snapshot.finished:  # ended just now: its result, as for a quick run
            return await self._inline_result(run_id, metadata, params.name)
        log.info("mcp_task_created", run_id=run_id, tool=params.name,
                 protocol=ctx.protocol_version)
        return {"resultType": "task", **self.runs.task(snapshot, legacy=False)}

    async def _inline_result(self, run_id: str, metadata: Metadata, tool_name: str
                             ) -> types.CallToolResult:
        snapshot = await self.runs.snapshot(run_id, metadata, with_result=True)
        return await self._call_result(snapshot, metadata, tool_name)

    async def _call_result(self, snapshot: RunSnapshot, metadata: Metadata,
                           tool_name: str = "") -> types.CallToolResult:
        assert snapshot.final is not None
        name = tool_name or snapshot.tool_name
        declared = bool(name and snapshot.final.result.HasField("structured_output")
                        and await self._declares_output_schema(name, metadata))
        return self.runs.call_result(snapshot, declares_output_schema=declared)

    # -- tasks/* -------------------------------------------------------------------------

    def _era(self, ctx: ServerRequestContext[Any, Any], *, legacy_only: bool = False) -> bool:
        """Whether the request is of 2025-11-25 (legacy) tasks; checks that tasks exist in
        its version, and that a 2026-07-28 request declares the extension.

        Raises:
            MCPError: METHOD_NOT_FOUND in a version without tasks (or without this method);
                -32021 for a 2026-07-28 request without the extension.
        """
        if ctx.protocol_version == LEGACY_TASKS_VERSION:
            return True
        if ctx.protocol_version in MODERN_PROTOCOL_VERSIONS and not legacy_only:
            if not self.declares_tasks(ctx):
                raise MCPError(MISSING_REQUIRED_CLIENT_CAPABILITY,
                               "Missing required client capability", {
                                   "requiredCapabilities": {"extensions": {
                                       TASKS_EXTENSION: {}}}})
            return False
        raise MCPError(types.METHOD_NOT_FOUND, "Method not found", ctx.method)

    async def _get(self, ctx: ServerRequestContext[Any, Any], params: TaskIdParams
                   ) -> dict[str, Any]:
        legacy = self._era(ctx)
        metadata = self._credentials(ctx)
        snapshot = await self.runs.snapshot(params.task_id, metadata, with_result=not legacy)
        task = self.runs.task(snapshot, legacy=legacy)
        if not legacy and task["status"] == "completed":
            result = await self._call_result(snapshot, metadata)
            task["result"] = result.model_dump(by_alias=True, mode="json", exclude_none=True)
        return task

    async def _result(self, ctx: ServerRequestContext[Any, Any], params: TaskIdParams
                      ) -> types.CallToolResult:
        self._era(ctx, legacy_only=True)
        metadata = self._credentials(ctx)
        snapshot = await self.runs.wait_final(params.task_id, metadata)
        snapshot.tool_name = await self.runs.tool_of(params.task_id, metadata)
        return result_meta(await self._call_result(snapshot, metadata), params.task_id)

    async def _cancel(self, ctx: ServerRequestContext[Any, Any], params: TaskIdParams
                      ) -> dict[str, Any]:
        legacy = self._era(ctx)
        metadata = self._credentials(ctx)
        going = await self.runs.cancel(params.task_id, metadata)
        if not legacy:
            return {}  # an acknowledgement: cancelling is cooperative (SEP-2663)
        if not going:
            snapshot = await self.runs.snapshot(params.task_id, metadata)
            status = task_status(snapshot, legacy=True)
            raise MCPError(types.INVALID_PARAMS,
                           f"Cannot cancel task: already in terminal status '{status}'",
                           {"taskId": params.task_id, "status": status})
        try:  # the task is answered once its run has ended (cancelled, unless it won a race)
            snapshot = await asyncio.wait_for(self.runs.wait_final(params.task_id, metadata),
                                              CANCEL_WAIT_SECONDS)
        except TimeoutError:
            snapshot = await self.runs.snapshot(params.task_id, metadata)
        return self.runs.task(snapshot, legacy=True)

    async def _update(self, ctx: ServerRequestContext[Any, Any], params: TaskIdParams
                      ) -> dict[str, Any]:
        """2026-07-28 ``tasks/update``: a run never asks its client for input (its task is
        never ``input_required``), so every response is for a request that is not
        outstanding, which SEP-2663 has the server ignore: an acknowledgement, for a task the
        caller may see."""
        if self._era(ctx):
            raise MCPError(types.METHOD_NOT_FOUND, "Method not found", ctx.method)
        await self.runs.snapshot(params.task_id, self._credentials(ctx))
        return {}

    async def _list(self, ctx: ServerRequestContext[Any, Any],
                    params: types.PaginatedRequestParams) -> dict[str, Any]:
        self._era(ctx, legacy_only=True)
        snapshots, cursor = await self.runs.list_page(params.cursor, self._credentials(ctx))
        answer: dict[str, Any] = {"tasks": [self.runs.task(s, legacy=True) for s in snapshots]}
        if cursor:
            answer["nextCursor"] = cursor
        return answer

    async def _events(self, ctx: ServerRequestContext[Any, Any], params: RunEventsParams
                      ) -> dict[str, Any]:
        return await read_events(self._client, params, self._credentials(ctx))


def _refused(error: CallError, tool_name: str) -> MCPError:
    """A task-augmented call (2025-11-25) refused before its run started: a JSON-RPC error,
    since there is no task to answer with (an unknown tool or bad arguments are invalid
    params, as for a plain call)."""
    reason = error.reason or error.code.name
    data: dict[str, Any] = {"grpc_code": error.code.name, "reason": reason}
    if error.violations:
        data["violations"] = [{"field": v.field, "description": v.description}
                              for v in error.violations]
    if error.code is grpc.StatusCode.NOT_FOUND:
        return MCPError(types.INVALID_PARAMS, f"Unknown tool: {tool_name}", data)
    if error.code is grpc.StatusCode.UNAUTHENTICATED:
        return MCPError(UNAUTHENTICATED, error.message or "unauthenticated", data)
    if error.code is grpc.StatusCode.INVALID_ARGUMENT:
        return MCPError(types.INVALID_PARAMS, error.message, data)
    return MCPError(types.INVALID_REQUEST, f"{error.code.name} [{reason}]: {error.message}",
                    data)
