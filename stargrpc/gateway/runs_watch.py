"""The live run list of ``GET /v1/runs/events``: one ListRuns poll shared by like streams.

The progress page keeps one stream open; the gateway looks at the list every
:data:`RUNS_WATCH_SECONDS` and sends it again when it changed. Streams that ask the same
question share one poll: the same ListRuns request with the same credentials from the same
address (the call's metadata but for its trace context), so the same answer. However many
tabs show the list, the server gets one ListRuns a second for them, and the list is turned
into JSON and compared once per poll, not once per stream. The poll stops when its last
stream goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import structlog
from google.protobuf import json_format
from sse_starlette.event import ServerSentEvent

from stargrpc.gateway.client import TRACE_HEADERS, GatewayClient, Metadata
from stargrpc.gateway.sse import PING_SECONDS, encode_error, error_event
from stargrpc.v1 import tool_service_pb2

log = structlog.get_logger("stargrpc.gateway")

#: How often a poll looks at the run list for changes.
RUNS_WATCH_SECONDS = 1.0

#: Metadata that travels with a call but does not change its answer.
_UNCHANGING = frozenset(TRACE_HEADERS)

_Key = tuple[bytes, tuple[tuple[str, str], ...]]


def runs_json(reply: tool_service_pb2.ListRunsResponse) -> dict[str, Any]:
    """A page of ListRuns as the HTTP API shows it."""
    return json_format.MessageToDict(reply, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True)


def _body(reply: tool_service_pb2.ListRunsResponse) -> bytes:
    return json.dumps(runs_json(reply), separators=(",", ":")).encode()


class _Poll:
    """One ListRuns question asked every few seconds for the streams that share it.

    Attributes:
        body: The latest list, as compact JSON.
        error: The SSE ``error`` event of what ended the poll (a refusal, a failure), once
            something did.
        streams: How many streams follow it.
        changed: Set when ``body`` or ``error`` changes (then replaced by a fresh one).
    """

    body: bytes
    error: bytes | None
    streams: int
    changed: asyncio.Event
    task: asyncio.Task[None] | None

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.error = None
        self.streams = 0
        self.changed = asyncio.Event()
        self.task = None

    def tell(self) -> None:
        """Wakes the streams that follow this poll."""
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()

    async def run(self, client: GatewayClient, request: tool_service_pb2.ListRunsRequest,
                  metadata: Metadata, closing: asyncio.Event) -> None:
        while not closing.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(closing.wait(), RUNS_WATCH_SECONDS)
            if closing.is_set():
                break
            try:
                reply = await client.list_runs(request, metadata)
            except grpc.aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.UNAVAILABLE:
                    continue  # the store is away for now: keep the last list shown
                self.error = encode_error(error)
                break
            except Exception:  # the gateway's own fault: its streams are told, not left
                log.exception("run_list_poll_failed")
                self.error = error_event(grpc.StatusCode.INTERNAL,
                                         "the gateway failed to read the run list")
                break
            body = _body(reply)
            if body != self.body:
                self.body = body
                self.tell()
        self.tell()


class RunListWatch:
    """The polls of the live run list, one per distinct question."""

    _client: GatewayClient
    _closing: asyncio.Event
    _polls: dict[_Key, _Poll]

    def __init__(self, client: GatewayClient, closing: asyncio.Event) -> None:
        self._client = client
        self._closing = closing
        self._polls = {}

    @property
    def polls(self) -> int:
        """How many polls run now."""
        return len(self._polls)

    async def follow(self, request: tool_service_pb2.ListRunsRequest, metadata: Metadata,
                     first: tool_service_pb2.ListRunsResponse) -> AsyncIterator[bytes]:
        """The stream's SSE chunks: ``first`` as a ``runs`` event, then the list again each
        time it changes, keep-alives while it does not; until the gateway closes or the
        server refuses the question (an ``error`` event, then the end).

        Args:
            request: The ListRuns request.
            metadata: The call's metadata (the poll, when this stream starts it, uses it).
            first: The answer the stream got when it opened.
        """
        sent = _body(first)
        key = (request.SerializeToString(deterministic=True),
               tuple((k, v) for k, v in metadata if k not in _UNCHANGING))
        poll = self._polls.get(key)
        if poll is None:
            poll = self._polls[key] = _Poll(sent)
            poll.task = asyncio.create_task(
                poll.run(self._client, request, metadata, self._closing))
            # An ended poll (a refusal) is not joined by the streams that open after it.
            poll.task.add_done_callback(lambda _: self._forget(key, poll))
        poll.streams += 1
        try:
            yield ServerSentEvent(sent.decode(), event="runs", sep="\n").encode()
            while not self._closing.is_set():
                if poll.body != sent:
                    sent = poll.body
                    yield ServerSentEvent(sent.decode(), event="runs", sep="\n").encode()
                if poll.error is not None:
                    yield poll.error
                    return
                if poll.task is not None and poll.task.done():
                    return  # closing
                changed = poll.changed
                try:
                    await asyncio.wait_for(changed.wait(), PING_SECONDS)
                except TimeoutError:
                    yield ServerSentEvent(comment="keep-alive", sep="\n").encode()
        finally:
            poll.streams -= 1
            if not poll.streams:
                self._forget(key, poll)
                if poll.task is not None:
                    poll.task.cancel()

    def wake_all(self) -> None:
        """Wakes every stream waiting for its poll (the gateway is closing: they end rather
        than wait for a ListRuns in flight to come back)."""
        for poll in list(self._polls.values()):
            poll.tell()

    def _forget(self, key: _Key, poll: _Poll) -> None:
        if self._polls.get(key) is poll:
            del self._polls[key]
