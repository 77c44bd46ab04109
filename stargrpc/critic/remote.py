"""The remote critic: runs judged by a CriticService (``critic_url``) over gRPC.

Each supervised run opens one ``CriticService.Supervise`` stream (see
``protos/stargrpc/v1/critic.proto``): its start first, then each event as the run logs it,
and an ``Ask`` when the run's soft deadline is reached. The critic's verdicts come back on
the same stream whenever it likes. Events are queued for the stream and never wait for it;
a critic that falls this far behind (:data:`MAX_QUEUED`), ends the stream, loses the
connection or answers a message that is no verdict is reported to the supervision, which
hands the run to the rules. One channel serves every run of the server. A critic that
sends verdicts without pause costs the run's log nothing past
:data:`~stargrpc.critic.supervision.MAX_VERDICT_NOTICES` notices (the supervision's limit).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import structlog
from google.protobuf import json_format

from stargrpc.critic.base import (
    CriticError,
    Extend,
    Keep,
    RunJudge,
    RunStart,
    Steer,
    Stop,
    Verdict,
    VerdictSink,
    Warn,
)
from stargrpc.v1 import critic_pb2, critic_pb2_grpc, events_pb2

log = structlog.get_logger("stargrpc.critic")

#: Messages waiting for a slow critic's stream before the run is handed to the rules.
MAX_QUEUED = 10_000
#: How long a run's stream stays open after the run ended, for the critic to read the end.
CLOSE_GRACE_SECONDS = 1.0

_STOPPED = "CRITIC_STOPPED"


def verdict_of(response: critic_pb2.SuperviseResponse) -> Verdict:
    """The verdict a response carries.

    Raises:
        CriticError: The response carries none.
    """
    which = response.WhichOneof("verdict")
    if which == "extend":
        return Extend(response.extend.within.ToNanoseconds() / 1e9, response.extend.reason)
    if which == "warn":
        return Warn(response.warn.message)
    if which == "steer":
        return Steer(response.steer.message)
    if which == "stop":
        return Stop(response.stop.code or _STOPPED, response.stop.reason)
    if which == "keep":
        return Keep()
    raise CriticError("answered garbage (a response without a verdict)")


def start_message(start: RunStart) -> critic_pb2.SuperviseRequest:
    """The first message of a run's stream."""
    request = critic_pb2.SuperviseRequest()
    message = request.start
    message.run_id = start.run_id
    message.tool_name = start.tool
    message.principal = start.principal
    with contextlib.suppress(Exception):  # arguments protobuf cannot hold are left out
        json_format.ParseDict(dict(start.arguments), message.arguments)
    message.soft_timeout.FromNanoseconds(int(min(start.soft_timeout, 3e11) * 1e9))
    message.hard_timeout.FromNanoseconds(int(min(start.hard_timeout, 3e11) * 1e9))
    if start.deadline is not None:
        message.caller_deadline.FromNanoseconds(int(start.deadline * 1e9))
    return request


class RemoteCritic:
    """Runs judged by the CriticService at ``target`` (``host:port``).

    Attributes:
        name: ``remote``, the ``critic`` label of the verdict metric.
        target: Where the CriticService listens.
    """

    name = "remote"
    target: str
    _channel: grpc.aio.Channel | None
    _stub: critic_pb2_grpc.CriticServiceStub | None

    def __init__(self, target: str) -> None:
        self.target = target.removeprefix("grpc://")
        self._channel = None
        self._stub = None

    def judge(self, start: RunStart, verdicts: VerdictSink) -> RemoteJudge:
        """Opens the run's stream."""
        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(self.target)
            self._stub = critic_pb2_grpc.CriticServiceStub(self._channel)
        return RemoteJudge(self._stub, start, verdicts)

    async def aclose(self) -> None:
        """Closes the channel."""
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None


class RemoteJudge(RunJudge):
    """One run's stream to the remote critic."""

    _queue: asyncio.Queue[critic_pb2.SuperviseRequest | events_pb2.RunEvent | None]
    _verdicts: VerdictSink
    _call: grpc.aio.StreamStreamCall
    _reader: asyncio.Task[None]
    _closed: bool

    def __init__(self, stub: critic_pb2_grpc.CriticServiceStub, start: RunStart,
                 verdicts: VerdictSink) -> None:
        self._queue = asyncio.Queue(MAX_QUEUED)
        self._queue.put_nowait(start_message(start))
        self._verdicts = verdicts
        self._closed = False
        self._call = stub.Supervise(self._requests())
        self._reader = asyncio.get_running_loop().create_task(
            self._read(), name=f"critic-{start.run_id}")

    def observe(self, event: events_pb2.RunEvent) -> None:
        """Queues the event for the stream (sent once the run has logged it)."""
        self._send(event)

    def ask(self, idle: float) -> bool:
        """Asks the critic for a verdict: one is expected within the budget."""
        request = critic_pb2.SuperviseRequest()
        request.ask.idle.FromNanoseconds(int(idle * 1e9))
        return self._send(request)

    def _send(self, message: critic_pb2.SuperviseRequest | events_pb2.RunEvent) -> bool:
        if self._closed:
            return False
        try:
            self._queue.put_nowait(message)
        except asyncio.QueueFull:
            self._broken(CriticError(f"fell {MAX_QUEUED} messages behind"))
            return False
        return True

    def close(self) -> None:
        """Half-closes the stream; it is cancelled if the critic keeps it open."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(asyncio.QueueFull):
            self._queue.put_nowait(None)
        asyncio.get_running_loop().call_later(CLOSE_GRACE_SECONDS, self._call.cancel)

    def _broken(self, error: CriticError) -> None:
        if not self._closed:
            self.close()
            self._verdicts(error)

    async def _requests(self) -> AsyncIterator[critic_pb2.SuperviseRequest]:
        while (message := await self._queue.get()) is not None:
            if isinstance(message, events_pb2.RunEvent):
                request = critic_pb2.SuperviseRequest()
                request.event.CopyFrom(message)
                yield request
            else:
                yield message

    async def _read(self) -> None:
        try:
            async for response in self._call:
                if self._closed:
                    return
                self._verdicts(verdict_of(response))
            self._broken(CriticError("ended the stream"))
        except CriticError as error:
            self._broken(error)
        except grpc.aio.AioRpcError as error:
            code, details = error.code(), error.details() or ""
            # Undecodable bytes are INTERNAL, saying so; a connection broken mid-stream (the
            # critic killed) can be INTERNAL too ("Internal error from Core"): that is a
            # disconnection, not garbage.
            if code == grpc.StatusCode.INTERNAL and "serializ" in details.lower():
                self._broken(CriticError(f"answered garbage ({details})"))
            else:
                self._broken(CriticError(f"is unreachable or disconnected ({code.name})"))
        except asyncio.CancelledError:
            if not self._closed:
                raise
