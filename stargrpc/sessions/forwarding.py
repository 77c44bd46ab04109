"""Sessions in a fleet: which replica holds a session, and calls forwarded to it.

A session lives on the replica that created it (its sandbox is a process there). With a
fleet (``redis_url``) and ``session_advertise_address`` set, that replica records it in
Redis — ``<prefix>session:<id>`` holds the replica's address and the session's owner for
the session's TTL, and ``<prefix>session-lease:<id>`` lives ``LEASE_SECONDS`` and is renewed
while the replica holds the session.

A call naming a session another replica holds is forwarded there over gRPC
(:class:`SessionForwarder`): Execute, StartRun and CloseSession. The caller's credentials
never leave the replica they were presented to — neither its bearer token nor anything
derived from it. This replica has authenticated the caller already (whichever way: an API
key, a JWT, an mTLS certificate); it sends the owner, in ``stargrpc-session-forwarded``, an
assertion signed with ``fleet_secret`` naming that principal and binding it to this one
request (method, session, a digest of the request message, the owner's address, a time and
a nonce: :mod:`stargrpc.auth.fleet`). The owner accepts it only on those methods, only with
its own ``fleet_secret``, once, within 30 seconds, and runs the call as that principal; its
audit record names the replica that forwarded it. A replica the fleet's Redis was made to
name instead of the owner learns nothing it could use: no token, and an assertion no
replica accepts for any other request, nor for this one (it names another address). Without
``fleet_secret`` a call for a session held elsewhere is refused FAILED_PRECONDITION, reason
SESSION_FORWARDING_UNCONFIGURED; the caller's token is never relayed instead.

Without TLS the forwarded request (its arguments, the output streamed back) crosses the
network in plaintext, as any call to a plaintext replica does; with TLS the replicas reach
each other through :func:`replica_credentials`.

When the record is there but its lease is not (the owner died, or lost Redis for longer
than the lease), or the owner cannot be reached, the call is refused FAILED_PRECONDITION,
reason SESSION_LOST. A forwarded call is never forwarded again (no loops).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import structlog
from google.protobuf.message import Message

from stargrpc.auth.fleet import FORWARDED_HEADER, FleetAssertions
from stargrpc.contract import SERVICE_NAME
from stargrpc.errors import FailedPrecondition, NotFound, reason_name
from stargrpc.principal import Principal
from stargrpc.runs.call_record import current_call
from stargrpc.settings import Settings
from stargrpc.v1 import errors_pb2, tool_service_pb2

log = structlog.get_logger("stargrpc.sessions")

#: How long a replica's hold on a session outlives its last renewal.
LEASE_SECONDS = 10.0
#: The caller's metadata relayed to the owner: its trace context, never its credentials.
RELAYED_HEADERS = ("traceparent", "tracestate")


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


_LOST = reason_name(errors_pb2.SESSION_LOST)
_UNCONFIGURED = reason_name(errors_pb2.SESSION_FORWARDING_UNCONFIGURED)


def _unreachable(error: grpc.aio.AioRpcError) -> Exception:
    """What a failed call to the owner becomes: SESSION_LOST when the owner cannot be
    reached, the owner's own refusal otherwise."""
    if error.code() == grpc.StatusCode.UNAVAILABLE:
        return FailedPrecondition(f"the replica that holds the session cannot be reached "
                                  f"({error.details()}); the session is lost", reason=_LOST)
    return error


def replica_credentials(settings: Settings) -> grpc.ChannelCredentials | None:
    """How a replica reaches another that serves TLS (None: plaintext, as they serve).

    It trusts ``session_forward_ca_file`` (default ``http_grpc_ca_file``, else the
    replica's own ``tls_cert_file``) and presents ``session_forward_cert_file`` when given.

    Raises:
        OSError: A certificate or key file cannot be read.
    """
    if settings.tls_cert_file is None:
        return None
    roots = (settings.session_forward_ca_file or settings.http_grpc_ca_file
             or settings.tls_cert_file).read_bytes()
    cert, key = settings.session_forward_cert_file, settings.session_forward_key_file
    return grpc.ssl_channel_credentials(
        root_certificates=roots,
        private_key=key.read_bytes() if key is not None else None,
        certificate_chain=cert.read_bytes() if cert is not None else None)


class SessionForwarder:
    """Sends calls for a session to the replica that holds it, vouched for by this one."""

    directory: SessionDirectory
    #: Makes the assertion of each forwarded call (None: no ``fleet_secret``, no forwarding).
    assertions: FleetAssertions | None
    _channels: dict[str, grpc.aio.Channel]
    _credentials: grpc.ChannelCredentials | None

    def __init__(self, directory: SessionDirectory,
                 credentials: grpc.ChannelCredentials | None = None,
                 assertions: FleetAssertions | None = None) -> None:
        self.directory = directory
        self.assertions = assertions
        self._channels = {}
        self._credentials = credentials

    async def route(self, session_id: str, principal: str,
                    metadata: Sequence[tuple[str, Any]]) -> str | None:
        """The replica a call for ``session_id`` by ``principal`` goes to; None when no
        replica records it (the caller hears of an unknown session).

        Raises:
            NotFound: Another principal's session (SESSION_NOT_FOUND).
            FailedPrecondition: The holder is gone (SESSION_LOST), or this replica has no
                ``fleet_secret`` to forward with (SESSION_FORWARDING_UNCONFIGURED).
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
        if self.assertions is None:
            # Never the caller's own token instead: see the module's docstring.
            raise FailedPrecondition(
                "another replica of the fleet holds this session, and this replica cannot "
                "forward the call to it: fleet_secret is not set here (set the same "
                "fleet_secret on every replica, or call the replica that holds the session)",
                reason=_UNCONFIGURED, metadata={"session_id": session_id,
                                                "setting": "fleet_secret"})
        return owner.replica

    def _stub(self, replica: str) -> Any:
        channel = self._channels.get(replica)
        if channel is None:
            channel = (grpc.aio.secure_channel(replica, self._credentials)
                       if self._credentials is not None
                       else grpc.aio.insecure_channel(replica))
            self._channels[replica] = channel
        return channel

    def _outgoing(self, replica: str, method: str, request: Message, principal: Principal,
                  context: grpc.aio.ServicerContext) -> tuple[bytes, list[tuple[str, str]]]:
        """The bytes of ``request`` and the metadata that goes with it to ``replica``: the
        caller's trace context and this replica's assertion, never its credentials.

        Raises:
            FailedPrecondition: No ``fleet_secret``, or a principal too large to vouch for.
        """
        if self.assertions is None:
            raise FailedPrecondition("this replica cannot forward calls: fleet_secret is "
                                     "not set here", reason=_UNCONFIGURED,
                                     metadata={"setting": "fleet_secret"})
        # Deterministic, so the owner computes the same digest from the message it decodes.
        data = request.SerializeToString(deterministic=True)
        # The caller as this replica's audit records it (the HTTP client behind a call of
        # the gateway, vouched for), else the gRPC peer.
        record = current_call.get()
        peer = (record.peer if record is not None and record.peer else context.peer()) or ""
        try:
            assertion = self.assertions.make(
                method=method, session_id=getattr(request, "session_id", ""),
                principal=principal, peer=peer, to=replica,
                digest=hashlib.sha256(data).hexdigest())
        except ValueError as exc:
            raise FailedPrecondition(f"{exc}: call the replica that holds the session"
                                     ) from exc
        kept = [(key, value) for key, value in context.invocation_metadata() or ()
                if key in RELAYED_HEADERS and isinstance(value, str)]
        return data, [*kept, (FORWARDED_HEADER, assertion)]

    async def execute(self, replica: str, request: tool_service_pb2.ExecuteRequest,
                      principal: Principal, context: grpc.aio.ServicerContext
                      ) -> AsyncIterator[tool_service_pb2.ExecuteResponse]:
        """The owner's Execute stream, response by response.

        Args:
            replica: The owner's address.
            request: The caller's request, sent as it is.
            principal: The caller, authenticated here: the one the owner is told of.
            context: The caller's call (its peer, trace context and deadline).

        Raises:
            grpc.aio.AioRpcError: The owner refused the call (its status, as it gave it).
            FailedPrecondition: The owner cannot be reached (SESSION_LOST), or this replica
                cannot vouch for the caller (SESSION_FORWARDING_UNCONFIGURED).
        """
        name = f"/{SERVICE_NAME}/Execute"
        data, metadata = self._outgoing(replica, name, request, principal, context)
        method = self._stub(replica).unary_stream(
            name, request_serializer=_as_is,
            response_deserializer=tool_service_pb2.ExecuteResponse.FromString)
        call = method(data, metadata=metadata, timeout=context.time_remaining())
        try:
            async for response in call:
                yield response
        except grpc.aio.AioRpcError as error:
            raise _unreachable(error) from error
        finally:
            call.cancel()

    async def unary(self, replica: str, method_name: str, request: Message, reply_type: Any,
                    principal: Principal, context: grpc.aio.ServicerContext) -> Any:
        """A unary call (StartRun, CloseSession) on the owner; arguments as for
        :meth:`execute`.

        Raises:
            grpc.aio.AioRpcError: The owner refused the call.
            FailedPrecondition: The owner cannot be reached (SESSION_LOST), or this replica
                cannot vouch for the caller (SESSION_FORWARDING_UNCONFIGURED).
        """
        name = f"/{SERVICE_NAME}/{method_name}"
        data, metadata = self._outgoing(replica, name, request, principal, context)
        method = self._stub(replica).unary_unary(
            name, request_serializer=_as_is, response_deserializer=reply_type.FromString)
        try:
            return await method(data, metadata=metadata, timeout=context.time_remaining())
        except grpc.aio.AioRpcError as error:
            raise _unreachable(error) from error

    async def aclose(self) -> None:
        """Closes the channels to other replicas."""
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()


def _as_is(data: bytes) -> bytes:
    return data
