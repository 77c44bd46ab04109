"""What the MCP task tests share: the requests of tasks, built from the official SDK's types
(which define them but do not send them), and a wait for a task to reach a status."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Literal

import mcp_types as types
from mcp import Client
from mcp.client.extension import ClaimContext, ClientExtension, NotificationBinding, ResultClaim
from pydantic import ConfigDict, Field

from stargrpc.mcp.run_events import RUN_EVENTS_METHOD
from stargrpc.mcp.tasks import TASKS_EXTENSION

#: The terminal statuses of a task.
TERMINAL = ("completed", "failed", "cancelled")


class AnyResult(types.Result):
    """A result kept whole (the SDK's ``Result`` drops fields it does not know)."""

    model_config = ConfigDict(extra="allow")


class RunEventsParams(types.RequestParams):
    task_id: str = Field(alias="taskId")
    after_seq: int = Field(0, alias="afterSeq")
    max_events: int = Field(100, alias="maxEvents")
    wait_ms: int = Field(1000, alias="waitMs")


class RunEventsRequest(types.Request[RunEventsParams, str]):
    method: str = RUN_EVENTS_METHOD
    params: RunEventsParams


class AnyRequest(types.Request[types.GetTaskRequestParams, str]):
    """Any request with any params (``tasks/*`` with hostile input too: the SDK's own
    request types validate theirs)."""

    method: str
    params: Any = None
    name_param = None


class TaskIdRequest(AnyRequest):
    """A ``tasks/*`` request: its ``taskId`` goes in the ``Mcp-Name`` header (SEP-2663)."""

    name_param = "taskId"


class TaskHandle(types.Result):
    """A 2026-07-28 ``CreateTaskResult`` (``resultType: "task"``)."""

    model_config = ConfigDict(extra="allow")
    result_type: Literal["task"] = Field("task", alias="resultType")  # type: ignore[assignment]
    task_id: str = Field(alias="taskId")
    status: str


async def _poll_to_result(handle: TaskHandle, ctx: ClaimContext) -> types.CallToolResult:
    while True:
        task = (await ctx.session.send_request(
            TaskIdRequest(method="tasks/get", params={"taskId": handle.task_id}), AnyResult)
        ).model_dump(by_alias=True)
        if task["status"] == "completed":
            return types.CallToolResult.model_validate(task["result"])
        if task["status"] in TERMINAL:
            raise RuntimeError(f"task {handle.task_id} ended {task['status']}")
        await asyncio.sleep(0.05)


class TasksExtension(ClientExtension):
    """The client half of ``io.modelcontextprotocol/tasks`` on the SDK's extension API:
    declares the extension on every request, and resolves a task answer to ``tools/call``
    by polling ``tasks/get`` (the result comes inline once completed)."""

    identifier = TASKS_EXTENSION

    def claims(self) -> Sequence[ResultClaim[Any]]:
        return [ResultClaim(result_type="task", model=TaskHandle, resolve=_poll_to_result)]


async def legacy_task(client: Client, tool: str, arguments: dict[str, Any],
                      ttl: int | None = None) -> types.Task:
    """A task-augmented ``tools/call`` (2025-11-25); the task it made.

    The SDK's client checks a 2025-11-25 ``tools/call`` answer against ``CallToolResult``
    (its tasks are types only), so this call goes out raw on the session's dispatcher and
    its answer is read with the SDK's ``CreateTaskResult``."""
    params = types.CallToolRequestParams(name=tool, arguments=arguments,
                                         task=types.TaskMetadata(ttl=ttl))
    raw = await raw_request(client, "tools/call",
                            params.model_dump(by_alias=True, mode="json", exclude_none=True))
    return types.CreateTaskResult.model_validate(raw).task


async def raw_request(client: Client, method: str, params: dict[str, Any]) -> dict[str, Any]:
    """A request sent as it is, its answer unchecked (a handshake-era session)."""
    return dict(await client.session._dispatcher.send_raw_request(method, params, {}))


async def send(client: Client, method: str, params: Any,
               result: type[types.Result] = AnyResult) -> Any:
    """Any request, its result kept whole (a ``taskId`` string goes in ``Mcp-Name``)."""
    named = isinstance(params, dict) and isinstance(params.get("taskId"), str)
    request = (TaskIdRequest if named else AnyRequest)(method=method, params=params)
    return await client.session.send_request(request, result)


async def until_status(client: Client, task_id: str, wanted: tuple[str, ...]
                       ) -> dict[str, Any]:
    """Polls ``tasks/get`` until the task's status is one of ``wanted`` (bounded)."""
    async def poll() -> dict[str, Any]:
        while True:
            got = await send(client, "tasks/get", {"taskId": task_id})
            task = got.model_dump(by_alias=True)
            if task["status"] in wanted:
                return task
            await asyncio.sleep(0.05)

    return await asyncio.wait_for(poll(), 30)


class TaskStatusWatcher(ClientExtension):
    """Receives ``notifications/tasks/status`` (2025-11-25), which the SDK's client routes
    to an extension's binding (its core tables leave tasks out)."""

    identifier = "io.stargrpc/test-task-status"

    def __init__(self) -> None:
        self.statuses: list[types.TaskStatusNotificationParams] = []
        self.arrived = asyncio.Event()

    def notifications(self) -> Sequence[NotificationBinding[Any]]:
        return [NotificationBinding(method="notifications/tasks/status",
                                    params_type=types.TaskStatusNotificationParams,
                                    handler=self._on_status)]

    async def _on_status(self, params: types.TaskStatusNotificationParams) -> None:
        self.statuses.append(params)
        self.arrived.set()


def tasks_created(logs: list[dict[str, Any]]) -> list[str]:
    """The tools of the tasks the endpoint made, from ``structlog.testing.capture_logs``."""
    return [entry["tool"] for entry in logs if entry["event"] == "mcp_task_created"]
