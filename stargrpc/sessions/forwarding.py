"""Sessions in a fleet: which replica holds a session, and calls forwarded to it.

A session lives on the replica that created it (its sandbox is a process there). With a
fleet (``redis_url``) and ``session_advertise_address`` set, that replica records it in
Redis — ``<prefix>session:<id>`` holds the replica's address and the session's owner for
the session's TTL, and ``<prefix>session-lease:<id>`` lives ``LEASE_SECONDS`` and is renewed
while the replica holds the session. A call naming a session another replica holds is
forwarded there over gRPC (:class:`SessionForwarder`), with the caller's own credentials
(its ``authorization`` metadata): the owner authenticates the caller itself, exactly as
if it had been called directly, so identity never travels as a claim one replica makes to
another. A caller authenticated by an mTLS client certificate cannot be relayed so; its
calls are answered as for a session this replica does not know.

When the record is there but its lease is not (the owner died, or lost Redis for longer
than the lease), or the owner cannot be reached, the call is refused FAILED_PRECONDITION,
reason SESSION_LOST. A forwarded call carries ``stargrpc-session-forwarded``: the replica
receiving it never forwards it again (no loops).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import structlog

from stargrpc.contract import SERVICE_NAME
from stargrpc.errors import FailedPrecondition, NotFound
from stargrpc.v1 import tool_service_pb2

log = structlog.get_logger("stargrpc.sessions")

#: How long a replica's hold on a session outlives its last renewal.
LEASE_SECONDS = 10.0
#: Metadata marking a call one replica forwarded to another.
FORWARDED_HEADER = "stargrpc-session-forwarded"
#: The caller's metadata relayed to the owner: its credentials and its trace.
RELAYED_HEADERS = ("authorization", "traceparent", "tracestate")


@dataclass(frozen=True)
class SessionOwner:
    """Where a session lives, as the fleet's Redis records it.

    Attributes:
        replica: The owning replica's ``session_advertise_address``.
        principal: The principal id the session belongs to.
        alive: The owner's lease on it is current.
    """

    replica: str
    principal: str
    alive: bool


class SessionDirectory:
    """The fleet's record of which replica holds which session (in Redis).

    Attributes:
        address: This replica's address, as other replicas reach it.
    """

    address: str
    _redis: Any
    _prefix: str
    _held: dict[str, float]
    _renewer: asyncio.Task[None] | None

    def __init__(self, redis: Any, prefix: str, address: str) -> None:
        self._redis = redis
        self._prefix = prefix
        self.address = address
        self._held = {}
        self._renewer = None

    def _record_key(self, session_id: str) -> str:
        return f"{self._prefix}session:{session_id}"

    def _lease_key(self, session_id: str) -> str:
        return f"{self._prefix}session-lease:{session_id}"

    async def claim(self, session_id: str, principal: str, ttl_seconds: float) -> None:
        """Records this replica as the session's holder, for its TTL."""
        record = json.dumps({"replica": self.address, "principal": principal})
        await self._redis.set(self._record_key(session_id), record,
                              px=int(ttl_seconds * 1000) + 60_000)
        await self._redis.set(self._lease_key(session_id), self.address,
                              px=int(LEASE_SECONDS * 1000))
        self._held[session_id] = ttl_seconds
        if self._renewer is None:
            self._renewer = asyncio.create_task(self._renew(), name="session-leases")

    async def release(self, session_id: str) -> None:
        """Forgets the session (it was closed here); best effort."""
        self._held.pop(session_id, None)
        try:
            await self._redis.delete(self._record_key(session_id))
            await self._redis.delete(self._lease_key(session_id))
        except Exception:  # the record ends with its TTL anyway, the lease sooner
            log.warning("session_record_not_removed", session_id=session_id, exc_info=True)

    async def owner(self, session_id: str) -> SessionOwner | None:
        """Who holds ``session_id`` (None: no replica records it)."""
        raw = await self._redis.get(self._record_key(session_id))
        if raw is None:
            return None
        try:
            record = json.loads(raw)
            replica, principal = str(record["replica"]), str(record["principal"])
        except (ValueError, KeyError, TypeError):
            return None
        alive = await self._redis.exists(self._lease_key(session_id))
        return SessionOwner(replica, principal, bool(alive))

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(LEASE_SECONDS / 3)
            for session_id in list(self._held):
                try:
                    await self._redis.set(self._lease_key(session_id), self.address,
                                          px=int(LEASE_SECONDS * 1000))
                except Exception:  # Redis away: the next round tries again
                    log.warning("session_lease_not_renewed", session_id=session_id,
                                exc_info=True)
                    break

    async def aclose(self) -> None:
        """Stops renewing and removes this replica's records."""
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
            self._renewer = None
        for session_id in list(self._held):
            await self.release(session_id)


_LOST = "SESSION_LOST"


def _unreachable(error: grpc.aio.AioRpcError) -> Exception:
    """What a failed call to the owner becomes: SESSION_LOST when the owner cannot be
    reached, the owner's own refusal otherwise."""
    if error.code() == grpc.StatusCode.UNAVAILABLE:
        return FailedPrecondition(f"the replica that holds the session cannot be reached "
                                  f"({error.details()}); the session is lost", reason=_LOST)
    return error


class SessionForwarder:
    """Sends calls for a session to the replica that holds it."""

    directory: SessionDirectory
    _channels: dict[str, grpc.aio.Channel]
    _credentials: grpc.ChannelCredentials | None

    def __init__(self, directory: SessionDirectory,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        self.directory = directory
        self._channels = {}
        self._credentials = credentials

    async def route(self, session_id: str, principal: str,
                    metadata: Sequence[tuple[str, Any]]) -> str | None:
        """The replica a call for ``session_id`` by ``principal`` goes to; None when no
        replica records it (the caller hears of an unknown session).

        Raises:
            NotFound: Another principal's session (SESSION_NOT_FOUND).
            FailedPrecondition: The holder is gone (SESSION_LOST).
        """
        if any(key == FORWARDED_HEADER for key, _ in metadata):
            return None  # forwarded here already: never again
        owner = await self.directory.owner(session_id)
        if owner is None or owner.replica == self.directory.address:
            return None
        if owner.principal != principal:
            raise NotFound("unknown session (or closed, or expired, or not yours)",
                           reason="SESSION_NOT_FOUND")
        if not owner.alive:
            raise FailedPrecondition("the replica that held the session is gone; the "
                                     "session is lost", reason=_LOST,
                                     metadata={"session_id": session_id})
        return owner.replica

    def _stub(self, replica: str) -> Any:
        channel = self._channels.get(replica)
        if channel is None:
            channel = (grpc.aio.secure_channel(replica, self._credentials)
                       if self._credentials is not None
                       else grpc.aio.insecure_channel(replica))
            self._channels[replica] = channel
        return channel

    @staticmethod
    def relayed(metadata: Sequence[tuple[str, Any]]) -> list[tuple[str, str]]:
        """The caller's metadata that goes with a forwarded call."""
        kept = [(key, value) for key, value in metadata if key in RELAYED_HEADERS]
        return [*kept, (FORWARDED_HEADER, "1")]

    async def execute(self, replica: str, request: tool_service_pb2.ExecuteRequest,
                      metadata: Sequence[tuple[str, Any]],
                      timeout: float | None  # noqa: ASYNC109 (the call's gRPC deadline)
                      ) -> AsyncIterator[tool_service_pb2.ExecuteResponse]:
        """The owner's Execute stream, response by response.

        Raises:
            grpc.aio.AioRpcError: The owner refused the call (its status, as it gave it).
            FailedPrecondition: The owner cannot be reached (SESSION_LOST).
        """
        method = self._stub(replica).unary_stream(
            f"/{SERVICE_NAME}/Execute",
            request_serializer=tool_service_pb2.ExecuteRequest.SerializeToString,
            response_deserializer=tool_service_pb2.ExecuteResponse.FromString)
        call = method(request, metadata=self.relayed(metadata), timeout=timeout)
        try:
            async for response in call:
                yield response
        except grpc.aio.AioRpcError as error:
            raise _unreachable(error) from error
        finally:
            call.cancel()

    async def unary(self, replica: str, method_name: str, request: Any, reply_type: Any,
                    metadata: Sequence[tuple[str, Any]],
                    timeout: float | None  # noqa: ASYNC109 (the call's gRPC deadline)
                    ) -> Any:
        """A unary call (StartRun, CloseSession) on the owner.

        Raises:
            grpc.aio.AioRpcError: The owner refused the call.
            FailedPrecondition: The owner cannot be reached (SESSION_LOST).
        """
        method = self._stub(replica).unary_unary(
            f"/{SERVICE_NAME}/{method_name}",
            request_serializer=type(request).SerializeToString,
            response_deserializer=reply_type.FromString)
        try:
            return await method(request, metadata=self.relayed(metadata), timeout=timeout)
        except grpc.aio.AioRpcError as error:
            raise _unreachable(error) from error

    async def aclose(self) -> None:
        """Closes the channels to other replicas."""
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
