"""The gateway's side of gRPC: a client of this process's own ToolService.

Every HTTP request becomes a gRPC call — on the server's in-process channel when the server
runs in this process (:mod:`stargrpc.server.inprocess`), else on a channel to its address —
carrying the caller's credentials as metadata, so authentication, permissions, audit and
supervision are exactly those of a gRPC caller. A run started over HTTP belongs to no HTTP
connection: the gateway reads its Execute stream to the end in a task of its own (a closed
browser tab must not cancel the run), and HTTP clients follow it through WatchRun, which
replays from any seq.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
import structlog

from stargrpc.v1 import events_pb2, state_pb2_grpc, tool_service_pb2, tool_service_pb2_grpc

log = structlog.get_logger("stargrpc.gateway")

Metadata = Sequence[tuple[str, str]]

#: The trace context of a request: passed on to the gRPC call, never part of its answer.
TRACE_HEADERS = ("traceparent", "tracestate", "x-request-id")

#: The largest message the gateway's channel sends or receives, unless told.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

#: How much of a started run's events may wait for an HTTP client that streams them
#: (``Accept: text/event-stream``) but does not read them: past it the client's stream ends
#: and the client reconnects with ``Last-Event-ID``, as a WatchRun watcher too far behind
#: is cut (``max_watch_lag_events``).
MAX_QUEUED_EVENT_BYTES = 8 * 1024 * 1024

#: The same bound in events: a small event's parsed message weighs some ten times its
#: wire size, so the bytes alone let a stream of small deltas pile up a hundred MB.
MAX_QUEUED_EVENTS = 1000

#: Request headers passed on to the gRPC call as metadata (credentials, trace context).
FORWARDED_HEADERS = ("authorization", *TRACE_HEADERS)


@dataclass
class StartedRun:
    """A run the gateway started and is reading to its end.

    Attributes:
        run_id: The run's id.
        first: The first event of the run (or of its replay, for a repeated idempotency key).
        result: Resolves to the run's final event; fails when the stream broke first.
        events: The events after ``first`` as they arrive, when someone listens; a None
            marks the end of the stream.
    """

    run_id: str
    first: events_pb2.RunEvent
    result: asyncio.Future[events_pb2.RunEvent]
    events: asyncio.Queue[events_pb2.RunEvent | None] | None = field(default=None)
    #: The size of the events in ``events`` that nobody has taken yet.
    queued_bytes: int = 0

    def take(self, event: events_pb2.RunEvent | None) -> None:
        """``event`` was taken from ``events``."""
        if event is not None:
            self.queued_bytes -= event.ByteSize()


class GatewayClient:
    """The gRPC calls the gateway makes, on one channel to ``target``."""

    target: str
    _channel: grpc.aio.Channel | None
    _given: grpc.aio.Channel | None
    _stub: tool_service_pb2_grpc.ToolServiceStub | None
    _state_stub: state_pb2_grpc.RunStateServiceStub | None
    _pumps: set[asyncio.Task[None]]

    def __init__(self, target: str, *, credentials: grpc.ChannelCredentials | None = None,
                 server_name: str | None = None,
                 max_message_bytes: int = MAX_MESSAGE_BYTES,
                 channel: grpc.aio.Channel | None = None) -> None:
        """A client of the server at ``target``.

        Args:
            target: The server's gRPC address.
            credentials: TLS roots for a server that serves TLS.
            server_name: The name expected in the server's certificate.
            max_message_bytes: Largest message sent or received on the channel.
            channel: A channel to use instead of connecting to ``target``: the in-process
                one of a server in this process (:mod:`stargrpc.server.inprocess`), whose
                calls skip the loopback network; closed with the client.
        """
        self.target = target
        self._given = channel
        self._credentials = credentials
        self._server_name = server_name
        self._max_message_bytes = max_message_bytes
        self._channel = None
        self._stub = None
        self._state_stub = None
        self._pumps = set()

    async def start(self) -> None:
        """Opens the channel (in the running event loop)."""
        self._channel = self._given if self._given is not None else self._open()
        self._stub = tool_service_pb2_grpc.ToolServiceStub(self._channel)
        self._state_stub = state_pb2_grpc.RunStateServiceStub(self._channel)

    def _open(self) -> grpc.aio.Channel:
        """A channel to :attr:`target`, with the message limit and credentials given."""
        options: list[tuple[str, int | str]] = [
            ("grpc.max_receive_message_length", self._max_message_bytes),
            ("grpc.max_send_message_length", self._max_message_bytes),
        ]
        if self._credentials is None:
            return grpc.aio.insecure_channel(self.target, options=options)
        if self._server_name:
            # The loopback address is not the name in the server's certificate.
            options.append(("grpc.ssl_target_name_override", self._server_name))
        return grpc.aio.secure_channel(self.target, self._credentials, options=options)

    async def aclose(self) -> None:
        """Stops reading the streams still open and closes the channel."""
        for task in list(self._pumps):
            task.cancel()
        if self._pumps:
            await asyncio.gather(*self._pumps, return_exceptions=True)
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    @property
    def stub(self) -> tool_service_pb2_grpc.ToolServiceStub:
        """The ToolService stub."""
        if self._stub is None:
            raise RuntimeError("the gateway client is not started")
        return self._stub

    @property
    def state_stub(self) -> state_pb2_grpc.RunStateServiceStub:
        """The RunStateService stub."""
        if self._state_stub is None:
            raise RuntimeError("the gateway client is not started")
        return self._state_stub

    async def list_tools(self, metadata: Metadata, known_catalog_hash: str = ""
                         ) -> tool_service_pb2.ListToolsResponse:
        """ListTools.

        Raises:
            grpc.aio.AioRpcError: The call was refused.
        """
        request = tool_service_pb2.ListToolsRequest(known_catalog_hash=known_catalog_hash)
        return await self.stub.ListTools(request, metadata=metadata)

    async def list_runs(self, request: tool_service_pb2.ListRunsRequest, metadata: Metadata
                        ) -> tool_service_pb2.ListRunsResponse:
        """ListRuns.

        Raises:
            grpc.aio.AioRpcError: The call was refused (bad page token, …).
        """
        return await self.stub.ListRuns(request, metadata=metadata)

    async def cancel(self, run_id: str, reason: str, metadata: Metadata) -> bool:
        """CancelRun; whether the run was still going.

        Raises:
            grpc.aio.AioRpcError: The call was refused (unknown run, …).
        """
        reply = await self.stub.CancelRun(
            tool_service_pb2.CancelRunRequest(run_id=run_id, reason=reason), metadata=metadata)
        return reply.cancelled

    async def steer(self, run_id: str, message: str, metadata: Metadata) -> str:
        """SteerRun; the run steered.

        Raises:
            grpc.aio.AioRpcError: The call was refused (unknown run, finished, too long, …).
        """
        reply = await self.stub.SteerRun(
            tool_service_pb2.SteerRunRequest(run_id=run_id, message=message),
            metadata=metadata)
        return reply.run_id

    async def approve(self, request: tool_service_pb2.ApproveRunRequest, metadata: Metadata
                      ) -> tool_service_pb2.ApproveRunResponse:
        """ApproveRun.

        Raises:
            grpc.aio.AioRpcError: The call was refused (no role, another id, not waiting, …).
        """
        reply: tool_service_pb2.ApproveRunResponse = await self.stub.ApproveRun(
            request, metadata=metadata)
        return reply

    async def start_run(self, request: tool_service_pb2.ExecuteRequest, metadata: Metadata,
                        *, listen: bool = False) -> StartedRun:
        """Starts a run and keeps reading its Execute stream until the Result.

        Args:
            request: The Execute request.
            metadata: The caller's credentials and trace context.
            listen: Queue the events after the first one in ``StartedRun.events``.

        Raises:
            grpc.aio.AioRpcError: The call was refused before the run started.
        """
        call = self.stub.Execute(request, metadata=metadata)
        try:
            first = await call.read()
        except BaseException:
            call.cancel()
            raise
        if first is grpc.aio.EOF:  # the service always sends a Result; this is a broken stream
            code = await call.code()
            raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       "the Execute stream ended without events")
        started = StartedRun(
            run_id=first.event.run_id, first=first.event,
            result=asyncio.get_running_loop().create_future(),
            events=asyncio.Queue() if listen else None)
        if first.event.HasField("result"):
            started.result.set_result(first.event)
            if started.events is not None:
                started.events.put_nowait(None)
            return started
        task = asyncio.create_task(self._pump(call, started), name=f"gateway-{started.run_id}")
        self._pumps.add(task)
        task.add_done_callback(self._pumps.discard)
        return started

    async def _pump(self, call: grpc.aio.UnaryStreamCall, started: StartedRun) -> None:
        last: events_pb2.RunEvent | None = None
        try:
            while (response := await call.read()) is not grpc.aio.EOF:
                last = response.event
                if started.events is not None:
                    started.events.put_nowait(last)
                    started.queued_bytes += last.ByteSize()
                    if (started.queued_bytes > MAX_QUEUED_EVENT_BYTES
                            or started.events.qsize() > MAX_QUEUED_EVENTS):
                        # A listener that does not keep up: its stream ends here (the
                        # None), and it follows the run again with Last-Event-ID.
                        log.info("gateway_listener_behind", run_id=started.run_id,
                                 queued_bytes=started.queued_bytes)
                        started.events.put_nowait(None)
                        started.events = None
            if last is None or not last.HasField("result"):
                raise RuntimeError("the Execute stream ended before the Result")
            started.result.set_result(last)
        except asyncio.CancelledError:
            call.cancel()
            if not started.result.done():
                started.result.cancel()
            raise
        except (grpc.aio.AioRpcError, RuntimeError) as exc:
            log.warning("gateway_stream_broken", run_id=started.run_id, error=str(exc))
            if not started.result.done():
                started.result.set_exception(exc)
        finally:
            if started.events is not None:
                started.events.put_nowait(None)
            # Nobody may ever await the result (a 202 answer): do not warn about it.
            with contextlib.suppress(asyncio.CancelledError, Exception):
                if started.result.done() and not started.result.cancelled():
                    started.result.exception()

    def watch(self, run_id: str, after_seq: int, metadata: Metadata
              ) -> grpc.aio.UnaryStreamCall:
        """A WatchRun call (not yet read)."""
        return self.stub.WatchRun(
            tool_service_pb2.WatchRunRequest(run_id=run_id, after_seq=after_seq),
            metadata=metadata)
