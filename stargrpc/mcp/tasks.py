"""MCP tasks on stargrpc's runs: a task IS a run, its task id the run's id.

Nothing about a task is kept by the MCP endpoint: every answer is read from the run,
through the caller's own gRPC calls (StartRun, ListRuns, WatchRun after a seq, CancelRun),
so a task created on one replica is answered by any other, exactly to those who may see
the run (its owner, or a watcher or admin role); anyone else is told the task is not
found, as for an id that never existed.

Two protocol versions, two shapes (:mod:`stargrpc.mcp.bridge` routes the requests):

- 2025-11-25 (experimental tasks): the client asks for a task (``tools/call`` with
  ``task``); ``tasks/get`` answers the status, ``tasks/result`` waits for the
  ``CallToolResult``, ``tasks/list`` pages the caller's runs, ``tasks/cancel`` stops one and
  answers it cancelled; ``notifications/tasks/status`` follow the task on the session.
  An outcome other than OK is ``failed`` (the spec's reading of ``isError``).
- 2026-07-28 (``io.modelcontextprotocol/tasks``, SEP-2663): the server decides. A
  ``tools/call`` whose request declares the extension answers inline when its run ends
  within ``mcp_task_after_seconds``, else with a task (``resultType: "task"``);
  ``tasks/get`` carries the ``CallToolResult`` inline once it is ``completed`` (any
  outcome but CANCELLED: ``isError`` results are completed, ``failed`` is for JSON-RPC
  errors only); ``tasks/cancel`` is an acknowledgement.

Status messages come from the run: ``queued …`` and ``awaiting approval`` while the run
waits in a lane or for a person (:func:`waiting_message`), the step running now while it
runs, and how it ended.

TTL: a run stays readable for ``run_retention_seconds`` after it ends (and at least as
long as it runs), so a task's ``ttl`` is that promise counted from its creation: the time
it has run so far (its whole duration once ended) plus the retention. A requested ``ttl``
cannot lengthen it (the retention is the run store's, for every run alike); the answer
always states the actual one, as the specifications ask.
"""

from __future__ import annotations

import asyncio
import datetime
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import mcp_types as types
from mcp.shared.exceptions import MCPError
from pydantic import Field

from stargrpc.client.errors import CallError
from stargrpc.gateway.client import GatewayClient, Metadata
from stargrpc.ids import minted_ms
from stargrpc.mcp.mapping import ProgressView, call_result, protocol_error
from stargrpc.v1 import events_pb2, tool_service_pb2

#: The 2026-07-28 extension (SEP-2663).
TASKS_EXTENSION = "io.modelcontextprotocol/tasks"
#: The protocol version whose core carries the experimental tasks.
LEGACY_TASKS_VERSION = "2025-11-25"
#: ``_meta`` key tying a message to its task (2025-11-25).
RELATED_TASK_META_KEY = "io.modelcontextprotocol/related-task"
#: The polling interval a task suggests, in ms.
POLL_INTERVAL_MS = 1000
#: The longest task id looked up (a run id is 32 characters).
MAX_TASK_ID_CHARS = 200

#: ListRuns pages (of :data:`_PAGE` runs) read to find a task's run before asking WatchRun.
_SCAN_PAGES = 2
_PAGE = 200
#: Runs are listed newest first by when their replica made them: a run made this long
#: before the task's id was minted is past it (clock skew between replicas).
_SKEW_MS = 60_000
#: How long WatchRun may think about a run older than the runs ListRuns was asked for before
#: the run is taken to be going (a finished or unknown run is answered at once).
_PROBE_SECONDS = 2.0
_AFTER_EVERYTHING = 2**64 - 1
_TASK_ID = re.compile(r"[A-Za-z0-9_.:-]{1,200}")
#: RunState names by value; the waiting states by the numbers the run-state seam gives them,
#: for stubs generated before they were added.
_STATE_NAMES = {3: "RUN_STATE_QUEUED", 4: "RUN_STATE_AWAITING_APPROVAL",
                **{value: name for name, value in tool_service_pb2.RunState.items()}}

TaskStatus = str


class TaskIdParams(types.RequestParams):
    """The params of ``tasks/get``, ``tasks/result`` and ``tasks/cancel``."""

    task_id: str = Field(alias="taskId", min_length=1, max_length=MAX_TASK_ID_CHARS)


class TaskNotFound(MCPError):
    """An unknown, expired, malformed or another caller's task: one answer for each, so
    task ids of others cannot be probed."""

    def __init__(self, task_id: str) -> None:
        super().__init__(types.INVALID_PARAMS, "Failed to retrieve task: Task not found",
                         {"taskId": task_id[:MAX_TASK_ID_CHARS]})


@dataclass
class RunSnapshot:
    """A run as a task shows it.

    Attributes:
        run_id: The run (the task id).
        tool_name: The tool being run; empty when not known.
        finished: The run has sent its Result.
        created_ms: When the run was made (ms since the epoch).
        updated_ms: When its newest event was recorded.
        message: What it is doing, or how it ended.
        last_seq: The seq of its newest event.
        final: Its last event (the Result) once finished, when it was read.
        view: What the run streamed before its Result (file chunks), when read whole.
    """

    run_id: str
    tool_name: str
    finished: bool
    created_ms: int
    updated_ms: int
    message: str
    last_seq: int
    final: events_pb2.RunEvent | None = None
    view: ProgressView | None = None

    @property
    def outcome(self) -> int:
        """The Result's outcome (``events_pb2.Outcome``); 0 while running."""
        return self.final.result.outcome if self.final is not None else 0


def task_status(snapshot: RunSnapshot, *, legacy: bool) -> TaskStatus:
    """The task status of a run: ``working`` until its Result; then ``cancelled`` for a
    cancelled run, ``completed`` for an OK one, and for any other outcome ``failed`` in
    2025-11-25 (where a tool call's ``isError`` fails its task) and ``completed`` from
    2026-07-28 (where ``failed`` is for JSON-RPC errors only)."""
    if not snapshot.finished:
        return "working"
    if snapshot.outcome == events_pb2.OUTCOME_CANCELLED:
        return "cancelled"
    if snapshot.outcome == events_pb2.OUTCOME_OK or not legacy:
        return "completed"
    return "failed"


def waiting_message(summary: tool_service_pb2.RunSummary) -> str:
    """The status message of a run that has not ended, from its ListRuns summary: where it
    waits (queued in a lane, awaiting approval) or the step it is running.

    The waiting states (RunState 3 QUEUED, 4 AWAITING_APPROVAL) and their fields
    (``lane``, ``queue_position``; ``approval``) belong to the lanes and approval features;
    the fields are read by name, so the message shows what the server reports.
    """
    state = _STATE_NAMES.get(summary.state, "")
    if state == "RUN_STATE_QUEUED":
        lane = str(getattr(summary, "lane", "") or "")
        position = int(getattr(summary, "queue_position", 0) or 0)
        text = f"queued in lane {lane}" if lane else "queued"
        return f"{text} (position {position})" if position else text
    if state == "RUN_STATE_AWAITING_APPROVAL":
        approval = getattr(summary, "approval", None)
        approval_id = str(getattr(approval, "approval_id", "") or "")
        deadline = getattr(approval, "deadline", None)
        details = [f"approval {approval_id}"] if approval_id else []
        if deadline is not None and deadline.seconds:
            details.append(f"denied at {_iso(_ms(deadline))} unless decided")
        return f"awaiting approval ({', '.join(details)})" if details else "awaiting approval"
    return f"running: {summary.current_step}" if summary.current_step else "running"


def ended_message(final: events_pb2.RunEvent) -> str:
    """The status message of an ended run: its outcome, and its error when it failed."""
    result = final.result
    outcome = events_pb2.Outcome.Name(result.outcome).removeprefix("OUTCOME_")
    if result.outcome == events_pb2.OUTCOME_OK:
        return "completed"
    detail = f" [{result.error.code}]" if result.error.code else ""
    message = f": {result.error.message}" if result.error.message else ""
    return f"{outcome}{detail}{message}"


def _iso(ms: int) -> str:
    return datetime.datetime.fromtimestamp(ms / 1000, datetime.UTC).isoformat(
        timespec="milliseconds").replace("+00:00", "Z")


def _ms(stamp: Any) -> int:
    return int(stamp.seconds * 1000 + stamp.nanos // 1_000_000)


class TaskRuns:
    """Tasks read from, and acted on through, a stargrpc server's runs.

    Attributes:
        client: The gRPC client of the server.
        retention_ms: How long the server keeps a finished run (``run_retention_seconds``).
    """

    client: GatewayClient
    retention_ms: int

    def __init__(self, client: GatewayClient, retention_seconds: float) -> None:
        self.client = client
        self.retention_ms = int(retention_seconds * 1000)

    # -- the task object -----------------------------------------------------------------

    def ttl_ms(self, snapshot: RunSnapshot) -> int:
        """How long from its creation the task is kept, at least: what it has run (its whole
        duration once ended) plus the run retention."""
        until = snapshot.updated_ms if snapshot.finished else int(time.time() * 1000)
        return max(0, until - snapshot.created_ms) + self.retention_ms

    def task(self, snapshot: RunSnapshot, *, legacy: bool) -> dict[str, Any]:
        """The ``Task`` of a run, in the wire shape of 2025-11-25 (``legacy``) or of the
        2026-07-28 extension."""
        return {
            "taskId": snapshot.run_id,
            "status": task_status(snapshot, legacy=legacy),
            "statusMessage": snapshot.message,
            "createdAt": _iso(snapshot.created_ms),
            "lastUpdatedAt": _iso(snapshot.updated_ms),
            "ttl" if legacy else "ttlMs": self.ttl_ms(snapshot),
            "pollInterval" if legacy else "pollIntervalMs": POLL_INTERVAL_MS,
        }

    # -- reading a run -------------------------------------------------------------------

    async def snapshot(self, task_id: str, metadata: Metadata, *,
                       with_result: bool = False) -> RunSnapshot:
        """The run behind ``task_id`` as the caller may see it.

        Args:
            task_id: The task (run) id.
            metadata: The caller's credentials.
            with_result: Read a finished run whole, so that ``final`` can become its
                ``CallToolResult`` (see :meth:`call_result`).

        Raises:
            TaskNotFound: Unknown, expired or not the caller's.
            MCPError: The server refused or could not be reached.
        """
        if not _TASK_ID.fullmatch(task_id):
            raise TaskNotFound(task_id)
        summary, looked_everywhere = await self._summary(task_id, metadata)
        if summary is None and looked_everywhere:
            # Every run the caller may see that is newer than this one was listed: a run made
            # for a task is listed before the task is answered (it carries an idempotency
            # key, which registers it), and ListRuns keeps finished runs as long as WatchRun.
            raise TaskNotFound(task_id)
        created = (_ms(summary.started_at) if summary is not None and summary.started_at.seconds
                   else minted_ms(task_id) or int(time.time() * 1000))
        tool = summary.tool_name if summary is not None else ""
        if summary is not None and summary.state != tool_service_pb2.RUN_STATE_FINISHED:
            updated = await self._event_time(task_id, summary.last_seq, metadata) or created
            return RunSnapshot(task_id, tool, False, created, updated,
                               waiting_message(summary), summary.last_seq)
        last_seq = summary.last_seq if summary is not None else await self._probe(
            task_id, metadata)
        if last_seq is None:  # going, older than the newest runs ListRuns was asked for
            return RunSnapshot(task_id, tool, False, created, created, "running", 0)
        # Its Result alone, or (for its CallToolResult) the whole run, files sent in chunks.
        final, view = await self._final(task_id, 0 if with_result else max(0, last_seq - 1),
                                        metadata)
        return RunSnapshot(task_id, tool, True, created, _ms(final.time),
                           ended_message(final), final.seq, final, view)

    @staticmethod
    def call_result(snapshot: RunSnapshot, *, declares_output_schema: bool
                    ) -> types.CallToolResult:
        """The ``CallToolResult`` of a finished run read ``with_result``."""
        assert snapshot.final is not None
        return call_result(snapshot.final, snapshot.view,
                           declares_output_schema=declares_output_schema)

    async def tool_of(self, run_id: str, metadata: Metadata) -> str:
        """The tool the run runs, when ListRuns shows the run among the caller's newest
        (empty when not)."""
        summary, _ = await self._summary(run_id, metadata)
        return summary.tool_name if summary is not None else ""

    async def _summary(self, run_id: str, metadata: Metadata
                       ) -> tuple[tool_service_pb2.RunSummary | None, bool]:
        """The run's ListRuns summary when it is among the caller's newest runs (it always
        is while a client polls a task it has just made), and whether the listing went past
        where the run would be (so that a run not found is not one the caller may see)."""
        minted = minted_ms(run_id)
        token = ""
        for _ in range(_SCAN_PAGES):
            try:
                page = await self.client.list_runs(tool_service_pb2.ListRunsRequest(
                    page_size=_PAGE, page_token=token), metadata)
            except grpc.aio.AioRpcError as error:
                raise protocol_error(CallError.from_rpc_error(error)) from None
            for run in page.runs:
                if run.run_id == run_id:
                    return run, True
                if minted is not None and _ms(run.started_at) < minted - _SKEW_MS:
                    return None, True  # listed newest first: it would have come before
            token = page.next_page_token
            if not token:
                return None, True
        return None, False

    async def _probe(self, run_id: str, metadata: Metadata) -> int | None:
        """Asks WatchRun for what follows the end of everything: the seq of the run's
        Result when it has ended, None when it is still going.

        Raises:
            TaskNotFound: Unknown, expired or not the caller's.
        """
        call = self.client.watch(run_id, _AFTER_EVERYTHING, metadata)
        try:
            await asyncio.wait_for(call.read(), _PROBE_SECONDS)
        except TimeoutError:
            return None
        except grpc.aio.AioRpcError as error:
            refused = CallError.from_rpc_error(error)
            if refused.reason == "RUN_FINISHED":
                return int(refused.metadata.get("last_seq", "0"))
            if refused.code is grpc.StatusCode.NOT_FOUND:
                raise TaskNotFound(run_id) from None
            raise protocol_error(refused) from None
        finally:
            call.cancel()
        return None

    async def _event_time(self, run_id: str, seq: int, metadata: Metadata) -> int | None:
        """When event ``seq`` of the run was recorded (None when it cannot be read)."""
        if seq <= 0:
            return None
        call = self.client.watch(run_id, seq - 1, metadata)
        try:
            reply = await asyncio.wait_for(call.read(), _PROBE_SECONDS)
        except (TimeoutError, grpc.aio.AioRpcError):
            return None
        finally:
            call.cancel()
        return None if reply is grpc.aio.EOF else _ms(reply.event.time)

    async def _final(self, run_id: str, after_seq: int, metadata: Metadata
                     ) -> tuple[events_pb2.RunEvent, ProgressView]:
        """The run's Result event and what streamed before it, read with WatchRun after
        ``after_seq`` (0: the whole run, so that files sent in chunks come back too)."""
        final = await self._read_to_result(run_id, after_seq, metadata, None)
        assert final.view is not None and final.final is not None
        return final.final, final.view

    async def wait_final(self, task_id: str, metadata: Metadata,
                         on_event: Callable[[events_pb2.RunEvent], Awaitable[None]] | None = None
                         ) -> RunSnapshot:
        """Follows the run to its end (the whole of it) and answers it finished and read
        whole; ``on_event`` sees every event before the Result.

        Raises:
            TaskNotFound: Unknown, expired or not the caller's.
        """
        if not _TASK_ID.fullmatch(task_id):
            raise TaskNotFound(task_id)
        return await self._read_to_result(task_id, 0, metadata, on_event)

    async def _read_to_result(self, run_id: str, after_seq: int, metadata: Metadata,
                              on_event: Callable[[events_pb2.RunEvent], Awaitable[None]] | None
                              ) -> RunSnapshot:
        """WatchRun after ``after_seq`` up to the Result, resumed after the last seq seen
        when the stream is cut.

        Raises:
            TaskNotFound: Unknown, expired (meanwhile) or not the caller's.
        """
        view = ProgressView()
        while True:
            call = self.client.watch(run_id, after_seq, metadata)
            try:
                while (reply := await call.read()) is not grpc.aio.EOF:
                    event = reply.event
                    after_seq = event.seq
                    if event.HasField("result"):
                        created = minted_ms(run_id) or _ms(event.time)
                        return RunSnapshot(run_id, "", True, created, _ms(event.time),
                                           ended_message(event), event.seq, event, view)
                    view.message(event)  # keeps file chunks for the Result
                    if on_event is not None:
                        await on_event(event)
            except grpc.aio.AioRpcError as error:
                refused = CallError.from_rpc_error(error)
                if refused.code is grpc.StatusCode.NOT_FOUND:
                    raise TaskNotFound(run_id) from None
                if refused.reason != "RUN_FINISHED":
                    raise protocol_error(refused) from None
                # Asked past its end (a resumed stream): read its Result.
                after_seq = max(0, int(refused.metadata.get("last_seq", "1")) - 1)
            finally:
                call.cancel()

    # -- acting on a run -----------------------------------------------------------------

    async def cancel(self, task_id: str, metadata: Metadata) -> bool:
        """CancelRun: whether the run was still going.

        Raises:
            TaskNotFound: Unknown, expired or not the caller's.
        """
        if not _TASK_ID.fullmatch(task_id):
            raise TaskNotFound(task_id)
        try:
            return await self.client.cancel(task_id, "the MCP client cancelled the task",
                                            metadata)
        except grpc.aio.AioRpcError as error:
            refused = CallError.from_rpc_error(error)
            if refused.code is grpc.StatusCode.NOT_FOUND:
                raise TaskNotFound(task_id) from None
            raise protocol_error(refused) from None

    async def list_page(self, cursor: str | None, metadata: Metadata
                        ) -> tuple[list[RunSnapshot], str]:
        """One page of the caller's runs (ListRuns) as tasks, newest first, and the cursor
        of the next page (empty after the last).

        Raises:
            MCPError: INVALID_PARAMS for a cursor ListRuns did not make.
        """
        try:
            page = await self.client.list_runs(tool_service_pb2.ListRunsRequest(
                page_size=50, page_token=cursor or ""), metadata)
        except grpc.aio.AioRpcError as error:
            refused = CallError.from_rpc_error(error)
            if refused.code is grpc.StatusCode.INVALID_ARGUMENT:
                raise MCPError(types.INVALID_PARAMS, "Invalid cursor",
                               {"cursor": (cursor or "")[:200]}) from None
            raise protocol_error(refused) from None
        snapshots = []
        for run in page.runs:
            finished = run.state == tool_service_pb2.RUN_STATE_FINISHED
            created = _ms(run.started_at)
            final = None
            message = waiting_message(run)
            updated = created
            if finished:  # the outcome is all ListRuns says of how it ended
                final = events_pb2.RunEvent(run_id=run.run_id, seq=run.last_seq)
                final.result.outcome = run.outcome
                message = ended_message(final)
                updated = _ms(run.ended_at) if run.ended_at.seconds else created
            snapshots.append(RunSnapshot(run.run_id, run.tool_name, finished, created,
                                         updated, message, run.last_seq, final))
        return snapshots, page.next_page_token


def result_meta(result: types.CallToolResult, task_id: str) -> types.CallToolResult:
    """``result`` tied to its task (``_meta[io.modelcontextprotocol/related-task]``), as
    ``tasks/result`` answers it in 2025-11-25."""
    meta = dict(result.meta or {})
    meta[RELATED_TASK_META_KEY] = {"taskId": task_id}
    return result.model_copy(update={"meta": meta})
