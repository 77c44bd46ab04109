"""How one MCP request shows its run's events: ``notifications/progress`` when the request
carried a progress token, log messages (``notifications/message``) when it did not and its
client may receive them, held until the call has run for ``mcp_progress_after_seconds``.

Progress is for calls long enough to need it. A notification before the result turns a
2026-07-28 answer from one JSON body into an SSE stream (the SDK commits to
``text/event-stream`` at the first notification), and FastMCP's client asks for progress on
every call: so a call that ends within the threshold is answered with its result alone.
One that runs longer shows the latest of its held events at once, then each as it comes.
The events held back and replaced are not lost to whoever wants every one: the run's event
stream (WatchRun, the ``io.stargrpc/run-events`` extension) and its output resource have
them all. Log messages follow the same rule: the bridge sends them for the same events,
as progress for a client that asked for none, not as a record of the run.

Handshake-era HTTP sessions answer every request POST as an SSE stream whatever is sent
before the result (the SDK's transport commits before the handler runs), so there the
threshold spares only the notifications themselves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection
from typing import Any

import anyio
import mcp_types as types
import structlog
from mcp.server.connection import allowed_log_levels
from mcp.server.context import ServerRequestContext

from stargrpc.v1 import events_pb2

log = structlog.get_logger("stargrpc.mcp")

#: Sends one event's notification: the event, its text (:class:`~stargrpc.mcp.mapping.
#: ProgressView`) and its log level.
Send = Callable[[events_pb2.RunEvent, str, str], Awaitable[None]]


class EventNotifications:
    """The notifications of one MCP request's run events, held back at first.

    Use as an async context manager around the request's following of its run: leaving it
    drops what is still held (the call answered within the threshold) and stops the timer,
    so no notification follows the result.
    """

    _loop: asyncio.AbstractEventLoop
    _send: Send | None
    _levels: Collection[str] | None
    _deadline: float
    _released: bool
    _held: tuple[events_pb2.RunEvent, str, str] | None
    # A timer handle until the deadline, then the task that releases: most calls end
    # before it, and a handle is cheaper to make and cancel than a task.
    _timer: asyncio.TimerHandle | None
    _releasing: asyncio.Task[None] | None
    _lock: asyncio.Lock

    def __init__(self, send: Send | None, after: float, *,
                 levels: Collection[str] | None = None) -> None:
        """Notifications sent by ``send`` once ``after`` seconds have passed (made in the
        event loop that runs the request).

        Args:
            send: Sends one notification; None when the request may receive none.
            after: Seconds from now during which events are held (0: none are).
            levels: The log levels the request may receive (None: every level).
        """
        self._send = send
        self._levels = levels
        self._loop = asyncio.get_running_loop()
        self._deadline = self._loop.time() + after
        self._released = after <= 0
        self._held = None
        self._timer = None
        self._releasing = None
        self._lock = asyncio.Lock()

    async def __aenter__(self) -> EventNotifications:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def show(self, event: events_pb2.RunEvent, text: str, level: str = "info") -> None:
        """Shows one event: at once once released, else held (replacing the one held)
        until the threshold passes."""
        if self._send is None or (self._levels is not None and level not in self._levels):
            return
        if not self._released:
            if self._loop.time() < self._deadline:
                self._held = (event, text, level)
                if self._timer is None:
                    self._timer = self._loop.call_at(self._deadline, self._due)
                return
            self._released = True
        async with self._lock:
            await self._flush()
            await self._send(event, text, level)

    async def release(self) -> None:
        """Ends the hold: the latest event held is shown now, every later one as it
        comes."""
        async with self._lock:
            self._released = True
            await self._flush()

    async def close(self) -> None:
        """Drops what is held and stops the timer (idempotent)."""
        self._held = None
        if self._timer is not None:
            self._timer.cancel()
        releasing, self._releasing = self._releasing, None
        if releasing is not None and not releasing.done():
            releasing.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.wait({releasing})

    async def _flush(self) -> None:
        held, self._held = self._held, None
        if held is not None and self._send is not None:
            await self._send(*held)

    def _due(self) -> None:
        if self._held is not None:
            self._releasing = self._loop.create_task(self._release_now(),
                                                     name="mcp-held-notifications")

    async def _release_now(self) -> None:
        try:
            await self.release()
        except Exception as exc:  # the session or its stream went away: the call ends too
            log.debug("mcp_notification_failed", error=repr(exc))


def event_notifications(ctx: ServerRequestContext[Any, Any], after: float
                        ) -> EventNotifications:
    """How one request shows its run's events: progress notifications when it asked for
    them, log messages (at the levels its client may receive) if not; held ``after``
    seconds."""
    meta = ctx.meta or {}
    token = meta.get("progress_token", meta.get("progressToken"))
    if token is not None:
        async def progress(event: events_pb2.RunEvent, text: str, level: str) -> None:
            await ctx.session.report_progress(float(event.seq), None, text)
        return EventNotifications(progress, after)

    allowed = allowed_log_levels(ctx.protocol_version, ctx.meta)
    if not allowed:
        return EventNotifications(None, after)

    async def log_message(event: events_pb2.RunEvent, text: str, level: str) -> None:
        await ctx.session.send_notification(
            types.LoggingMessageNotification(params=types.LoggingMessageNotificationParams(
                level=level,
                logger="stargrpc",
                data={"run_id": event.run_id, "seq": event.seq, "message": text})),
            related_request_id=ctx.request_id)
    return EventNotifications(log_message, after, levels=allowed)
