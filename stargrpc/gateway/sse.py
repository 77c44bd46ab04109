"""Run events as Server-Sent Events.

Each event goes out as ``id: <seq>``, ``event: <kind>`` (step, heartbeat, notice, file_chunk,
result) and ``data: <the RunEvent as JSON>`` (protobuf's JSON mapping, proto field names), so
a client that reconnects with ``Last-Event-ID: <seq>`` gets exactly the events after it. The
stream ends after the ``result`` event. While a run is quiet a comment line goes out every
few seconds so that proxies keep the connection open and a vanished client is noticed.
A failure after the stream has started travels as an ``error`` event with the same JSON body
as an HTTP error answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf import json_format
from sse_starlette.event import ServerSentEvent

from stargrpc.gateway.client import StartedRun
from stargrpc.gateway.http_errors import HTTP_STATUS, error_body, is_run_finished
from stargrpc.v1 import events_pb2

#: Seconds between keep-alive comments on a quiet stream.
PING_SECONDS = 10.0
#: How long a browser waits before reconnecting (sent as ``retry:``), in milliseconds.
RECONNECT_MILLIS = 1000


class EventSource:
    """Where the events of a stream come from, one read ahead: a WatchRun call or a run
    the gateway started. Subclasses say how to read one event."""

    _pending: asyncio.Future[events_pb2.RunEvent | None] | None = None

    async def _read(self) -> events_pb2.RunEvent | None:
        raise NotImplementedError

    def next_event(self) -> asyncio.Future[events_pb2.RunEvent | None]:
        """The next event (None at the end): the same future until :meth:`advance`."""
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._read())
        return self._pending

    def advance(self) -> None:
        """The event of :meth:`next_event` has been used; read the one after it."""
        self._pending = None

    def close(self) -> None:
        """Stops reading; called once when the HTTP stream ends for any reason."""
        if self._pending is not None and not self._pending.done():
            self._pending.cancel()


class WatchSource(EventSource):
    """The events of a WatchRun call."""

    def __init__(self, call: grpc.aio.UnaryStreamCall) -> None:
        self._call = call

    async def _read(self) -> events_pb2.RunEvent | None:
        response = await self._call.read()
        if response is grpc.aio.EOF:
            return None
        event: events_pb2.RunEvent = response.event
        return event

    def close(self) -> None:
        """Stops reading and cancels the call."""
        super().close()
        self._call.cancel()


class QueueSource(EventSource):
    """The events of a run the gateway started, from its own Execute stream."""

    def __init__(self, started: StartedRun) -> None:
        if started.events is None:
            raise ValueError("the run was started without listen=True")
        self._started = started
        self._queue: asyncio.Queue[events_pb2.RunEvent | None] = started.events
        self._first: events_pb2.RunEvent | None = started.first

    async def _read(self) -> events_pb2.RunEvent | None:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        event = await self._queue.get()
        self._started.take(event)
        return event

    def close(self) -> None:
        """Stops listening; the run goes on."""
        super().close()
        self._started.events = None


def event_json(event: events_pb2.RunEvent) -> dict[str, Any]:
    """A RunEvent in protobuf's JSON mapping with proto field names."""
    return json_format.MessageToDict(event, preserving_proto_field_name=True)


def encode_event(event: events_pb2.RunEvent, *, retry: int | None = None) -> bytes:
    """One RunEvent as an SSE message (with a reconnection delay, when given)."""
    data = json.dumps(event_json(event), separators=(",", ":"), ensure_ascii=False)
    return ServerSentEvent(data, event=event.WhichOneof("kind") or "event",
                           id=str(event.seq), retry=retry, sep="\n").encode()


def encode_error(error: grpc.aio.AioRpcError) -> bytes:
    """A failed gRPC stream as an SSE ``error`` event."""
    code = error.code()
    return error_event(code, error.details() or code.name)


def error_event(code: grpc.StatusCode, message: str) -> bytes:
    """An SSE ``error`` event with the gRPC status ``code`` and ``message``."""
    body = error_body(HTTP_STATUS.get(code, 500), code.name, message)
    return ServerSentEvent(json.dumps(body, separators=(",", ":")), event="error",
                           sep="\n").encode()


async def sse_stream(source: EventSource, closing: asyncio.Event, *,
                     ping_seconds: float = PING_SECONDS) -> AsyncIterator[bytes]:
    """The SSE body of a run: its events until the Result, keep-alive comments meanwhile.

    Ends early, without a Result, when ``closing`` is set (the server is stopping; the
    client reconnects with Last-Event-ID elsewhere) or the gRPC stream fails.
    """
    closed = asyncio.ensure_future(closing.wait())
    retry: int | None = RECONNECT_MILLIS  # sent once, with the first event
    try:
        while True:
            pending = source.next_event()
            waiting: list[asyncio.Future[Any]] = [pending, closed]
            done, _ = await asyncio.wait(waiting, timeout=ping_seconds,
                                         return_when=asyncio.FIRST_COMPLETED)
            if pending in done:
                source.advance()
                try:
                    event = pending.result()
                except grpc.aio.AioRpcError as error:
                    # A watch that waited past the end of its run just ends; reconnecting
                    # with Last-Event-ID then gets 204.
                    if not is_run_finished(error):
                        yield encode_error(error)
                    return
                if event is None:
                    return
                yield encode_event(event, retry=retry)
                retry = None
                if event.HasField("result"):
                    return
            elif closed in done:
                return
            else:
                yield ServerSentEvent(comment="keep-alive", sep="\n").encode()
    finally:
        closed.cancel()
        source.close()
        with contextlib.suppress(asyncio.CancelledError):
            await closed
