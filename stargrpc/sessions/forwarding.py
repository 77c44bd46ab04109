"""Sessions in a fleet: which replica holds a session, and calls forwarded to it.

A session lives on the replica that created it (its sandbox is a process there). With a
fleet (``redis_url``) and ``session_advertise_address`` set, that replica records it in
Redis — ``<prefix>session:<id>`` holds the replica's address and the session's owner for
the session's TTL, and ``<prefix>session-lease:<id>`` lives ``LEASE_SECONDS`` and is renewed
while the replica holds the session. ``<prefix>session-index:<digest of the principal>`` is
a sorted set of the principal's session ids, each scored with its session's end (ms), the
set itself kept until its last session's end: what ListSessions reads to answer for the
whole fleet (:mod:`stargrpc.sessions.listing`). A closed session leaves it at once, an
expired one when it is next read, and so does an id whose record is gone or whose lease
lapsed; a replica that regains a lapsed lease puts its session back.

A call naming a session another replica holds is forwarded there over gRPC
(:class:`SessionForwarder`): Execute, StartRun and CloseSession; and ListSessions asks
each replica holding one of the caller's sessions for its own. The caller's credentials
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
import hashlib
import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import structlog
from google.protobuf.message import Message

from stargrpc.auth.fleet import FORWARDED_HEADER, FleetAssertions, request_digest
from stargrpc.contract import SERVICE_NAME
from stargrpc.errors import FailedPrecondition, NotFound, reason_name
from stargrpc.principal import Principal
from stargrpc.runs.call_record import current_call
from stargrpc.settings import Settings
from stargrpc.stores.background import stop_background
from stargrpc.v1 import errors_pb2, tool_service_pb2

log = structlog.get_logger("stargrpc.sessions")

#: How long a replica's hold on a session outlives its last renewal.
LEASE_SECONDS = 10.0
#: The caller's metadata relayed to the owner: its trace context, never its credentials.
RELAYED_HEADERS = ("traceparent", "tracestate")


#: Adds a session to its principal's index and keeps the index until its last session's
#: end. KEYS: the index; ARGV: the session id, its end (ms), the slack after it (ms).
INDEX_ADD = """
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
redis.call('PEXPIREAT', KEYS[1], math.floor(tonumber(last[2])) + tonumber(ARGV[3]))
return 1
"""
#: The longest id an index may list (ours are 36 characters).
MAX_LISTED_ID = 64
#: How long a record (and an index) outlives its session's TTL.
RECORD_SLACK_MS = 60_000


def is_forwarded(metadata: Sequence[tuple[str, Any]]) -> bool:
    """Whether a call's metadata marks it as forwarded by another replica."""
    return any(key == FORWARDED_HEADER for key, _ in metadata)


@dataclass(frozen=True)
class _Held:
    """A session this replica holds, as its directory needs to renew and release it."""

    principal: str
    ends_ms: int


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
    _held: dict[str, _Held]
    _renewer: asyncio.Task[None] | None

    def __init__(self, redis: Any, prefix: str, address: str) -> None:
        self._redis = redis
        self._prefix = prefix
        self.address = address
        self._held = {}
        self._renewer = None
        self._index_add = redis.register_script(INDEX_ADD)

    def _record_key(self, session_id: str) -> str:
        return f"{self._prefix}session:{session_id}"

    def _lease_key(self, session_id: str) -> str:
        return f"{self._prefix}session-lease:{session_id}"

    def _index_key(self, principal: str) -> str:
        # A digest: a principal id is any text, of any length.
        digest = hashlib.sha256(principal.encode("utf-8", "surrogatepass")).hexdigest()
        return f"{self._prefix}session-index:{digest[:32]}"

    async def claim(self, session_id: str, principal: str, ttl_seconds: float) -> None:
        """Records this replica as the session's holder, for its TTL, and the session in
        its principal's index."""
        ends_ms = int((time.time() + ttl_seconds) * 1000)
        record = json.dumps({"replica": self.address, "principal": principal})
        # The lease first, the index last: a reader of the index finds a record and a lease
        # behind every id it lists (else it would drop the id as lost).
        await self._redis.set(self._lease_key(session_id), self.address,
                              px=int(LEASE_SECONDS * 1000))
        await self._redis.set(self._record_key(session_id), record,
                              px=int(ttl_seconds * 1000) + RECORD_SLACK_MS)
        held = _Held(principal, ends_ms)
        self._held[session_id] = held
        await self._index(session_id, held)
        if self._renewer is None:
            self._renewer = asyncio.create_task(self._renew(), name="session-leases")

    async def _index(self, session_id: str, held: _Held) -> None:
        await self._index_add(keys=[self._index_key(held.principal)],
                              args=[session_id, held.ends_ms, RECORD_SLACK_MS])

    async def release(self, session_id: str) -> None:
        """Forgets the session (it was closed here); best effort."""
        held = self._held.pop(session_id, None)
        try:
            if held is not None:
                await self._redis.zrem(self._index_key(held.principal), session_id)
            await self._redis.delete(self._record_key(session_id))
            await self._redis.delete(self._lease_key(session_id))
        except Exception:  # the record ends with its TTL anyway, the lease sooner
            log.warning("session_record_not_removed", session_id=session_id, exc_info=True)

    async def listed(self, principal: str, limit: int) -> list[tuple[str, SessionOwner]]:
        """The live sessions the fleet records for ``principal``: each id with its holder,
        at most ``limit``, the soonest to end first. Ids of the index that are not live —
        ended, no record, another principal's record, no lease — are dropped from it.

        Raises:
            Exception: Redis failed (redis-py's errors, as they come).
        """
        key = self._index_key(principal)
        await self._redis.zremrangebyscore(key, "-inf", int(time.time() * 1000))
        members = await self._redis.zrange(key, 0, max(limit, 1) - 1)
        ids: list[str] = []
        stale: list[Any] = []
        for member in members:
            text = member.decode("utf-8", "replace") if isinstance(member, bytes) else member
            # Ours are 36 characters: anything longer was not put there by a replica.
            if isinstance(text, str) and 0 < len(text) <= MAX_LISTED_ID:
                ids.append(text)
            else:
                stale.append(member)
        # One round trip for them all (per node, on a cluster), not two per id.
        pipe = self._redis.pipeline(transaction=False)
        for session_id in ids:
            pipe.get(self._record_key(session_id))
            pipe.exists(self._lease_key(session_id))
        replies = await pipe.execute() if ids else []
        owners = [_owner(raw, bool(alive)) for raw, alive in zip(replies[::2], replies[1::2],
                                                                  strict=True)]
        live = []
        for session_id, owner in zip(ids, owners, strict=True):
            if owner is None or owner.principal != principal or not owner.alive:
                stale.append(session_id)
            else:
                live.append((session_id, owner))
        if stale:
            await self._redis.zrem(key, *stale)
        return live

    async def owner(self, session_id: str) -> SessionOwner | None:
        """Who holds ``session_id`` (None: no replica records it)."""
        raw = await self._redis.get(self._record_key(session_id))
        if raw is None or _owner(raw, False) is None:
            return None
        alive = await self._redis.exists(self._lease_key(session_id))
        return _owner(raw, bool(alive))

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(LEASE_SECONDS / 3)
            for session_id, held in list(self._held.items()):
                try:
                    before = await self._redis.set(self._lease_key(session_id), self.address,
                                                   px=int(LEASE_SECONDS * 1000), get=True)
                    if before is None and session_id in self._held:
                        # The lease had lapsed (Redis was away): a reader of the index may
                        # have dropped the session as lost; it is held here still.
                        await self._index(session_id, held)
                except Exception:  # Redis away: the next round tries again
                    log.warning("session_lease_not_renewed", session_id=session_id,
                                exc_info=True)
                    break

    async def aclose(self) -> None:
        """Stops renewing and removes this replica's records."""
        task, self._renewer = self._renewer, None
        await stop_background(task, "session-leases")
        for session_id in list(self._held):
            await self.release(session_id)


def _owner(raw: Any, alive: bool) -> SessionOwner | None:
    """The holder a session's record names (None: no record, or not one a replica wrote)."""
    if raw is None:
        return None
    try:
        record = json.loads(raw)
        return SessionOwner(str(record["replica"]), str(record["principal"]), alive)
    except (ValueError, KeyError, TypeError):
        return None


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
        if is_forwarded(metadata):
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
                digest=request_digest(request))
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
                    principal: Principal, context: grpc.aio.ServicerContext, *,
                    within: float | None = None) -> Any:
        """A unary call (StartRun, CloseSession, ListSessions) on the owner; arguments as
        for :meth:`execute`, and ``within``: seconds it may take at most (besides the
        caller's deadline).

        Raises:
            grpc.aio.AioRpcError: The owner refused the call.
            FailedPrecondition: The owner cannot be reached (SESSION_LOST), or this replica
                cannot vouch for the caller (SESSION_FORWARDING_UNCONFIGURED).
        """
        name = f"/{SERVICE_NAME}/{method_name}"
        data, metadata = self._outgoing(replica, name, request, principal, context)
        method = self._stub(replica).unary_unary(
            name, request_serializer=_as_is, response_deserializer=reply_type.FromString)
        remaining = context.time_remaining()
        if within is not None:
            remaining = within if remaining is None else min(remaining, within)
        try:
            return await method(data, metadata=metadata, timeout=remaining)
        except grpc.aio.AioRpcError as error:
            raise _unreachable(error) from error

    async def aclose(self) -> None:
        """Closes the channels to other replicas."""
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()


def _as_is(data: bytes) -> bytes:
    return data
