"""``io.stargrpc/run-events``: a task's (a run's) events after a seq, for MCP clients.

2026-07-28 tasks carry no progress, and a 2025-11-25 client that lost its session lost
the progress notifications of its tasks. Runs keep every event in a log with a gapless
seq that WatchRun replays after any seq, on any replica; this extension hands that log to
an MCP client, one long-poll at a time:

request ``stargrpc/runs/events``, params::

    {"taskId": "<task or run id>", "afterSeq": 0, "maxEvents": 100, "waitMs": 1000}

result::

    {"events": [<RunEvent as protobuf JSON>, ...], "lastSeq": 7, "finished": false}

The answer comes when ``maxEvents`` events are there, when the run's Result is among them
(``finished``: nothing follows), or when ``waitMs`` has passed (possibly with no event).
Ask again with ``afterSeq`` = ``lastSeq`` to go on; every event comes exactly once, in
order. A task asked for after its end answers no events, ``finished`` true. The events are
those WatchRun streams (steps, deltas, heartbeats, notices, file chunks, the Result), in
the JSON form of ``stargrpc.v1.RunEvent``; who may read them is who may watch the run.
Advertised under ``capabilities.extensions`` (2026-07-28) and ``capabilities.experimental``
(2025-11-25) as ``{"method": "stargrpc/runs/events"}``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import mcp_types as types
from google.protobuf import json_format
from mcp.shared.exceptions import MCPError
from pydantic import Field

from stargrpc.client.errors import CallError
from stargrpc.gateway.client import GatewayClient, Metadata
from stargrpc.mcp.mapping import protocol_error
from stargrpc.mcp.tasks import MAX_TASK_ID_CHARS, TaskNotFound

#: The extension's identifier.
RUN_EVENTS_EXTENSION = "io.stargrpc/run-events"
#: The request method it adds.
RUN_EVENTS_METHOD = "stargrpc/runs/events"
#: The most events one answer holds.
MAX_EVENTS = 1000
#: The longest long-poll, in ms.
MAX_WAIT_MS = 30_000


class RunEventsParams(types.RequestParams):
    """The params of ``stargrpc/runs/events``."""

    task_id: str = Field(alias="taskId", min_length=1, max_length=MAX_TASK_ID_CHARS)
    after_seq: int = Field(0, alias="afterSeq", ge=0, le=2**63 - 1)
    max_events: int = Field(100, alias="maxEvents", ge=1, le=MAX_EVENTS)
    wait_ms: int = Field(1000, alias="waitMs", ge=0, le=MAX_WAIT_MS)


def capability() -> dict[str, Any]:
    """What the server advertises for the extension."""
    return {"method": RUN_EVENTS_METHOD, "maxEvents": MAX_EVENTS, "maxWaitMs": MAX_WAIT_MS}


async def read_events(client: GatewayClient, params: RunEventsParams, metadata: Metadata
                      ) -> dict[str, Any]:
    """One long-poll of a run's events (see the module's docstring).

    Raises:
        TaskNotFound: Unknown, expired or not the caller's.
        MCPError: The server refused or could not be reached.
    """
    events: list[dict[str, Any]] = []
    last_seq = params.after_seq
    finished = False
    deadline = time.monotonic() + params.wait_ms / 1000
    call = client.watch(params.task_id, params.after_seq, metadata)
    try:
        while len(events) < params.max_events:
            left = deadline - time.monotonic()
            if left <= 0 and events:
                break
            try:
                reply = await asyncio.wait_for(call.read(), max(left, 0.001))
            except TimeoutError:
                break
            if reply is grpc.aio.EOF:
                break
            event = reply.event
            events.append(json_format.MessageToDict(event))
            last_seq = event.seq
            if event.HasField("result"):
                finished = True
                break
    except grpc.aio.AioRpcError as error:
        refused = CallError.from_rpc_error(error)
        if refused.reason == "RUN_FINISHED":
            finished = True
            last_seq = max(last_seq, int(refused.metadata.get("last_seq", "0") or 0))
        elif refused.code is grpc.StatusCode.NOT_FOUND:
            raise TaskNotFound(params.task_id) from None
        elif refused.code is grpc.StatusCode.INVALID_ARGUMENT:
            raise MCPError(types.INVALID_PARAMS, refused.message, {
                "reason": refused.reason}) from None
        else:
            raise protocol_error(refused) from None
    finally:
        call.cancel()
    return {"events": events, "lastSeq": last_seq, "finished": finished}
