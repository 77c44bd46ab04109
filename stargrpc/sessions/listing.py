"""ListSessions for a whole fleet: the caller's sessions on every replica, from any of them.

The replica a ListSessions reaches answers for its own sessions itself. With a fleet
(:mod:`stargrpc.sessions.forwarding`) it then reads the caller's index in Redis — the ids of
the principal's live sessions and which replica holds each — and asks each other replica
that holds one for the caller's sessions there, with the same signed assertion a forwarded
Execute carries (the request as it came, ``with_files`` included: a session's files are
listed by the replica whose disk holds them). The answers are merged, oldest first.

- Redis not answering within ``redis_timeout_seconds``: the call is refused UNAVAILABLE (with
  RetryInfo) — never a partial list passed off as the whole.
- A replica that holds some of the caller's sessions and cannot be reached within
  :data:`ASK_SECONDS` (or the caller's deadline): its sessions are left out — a call in them
  would be refused SESSION_LOST all the same. So are the sessions of other replicas when
  this one has no ``fleet_secret`` to ask them with.
- A forwarded ListSessions is answered with the replica's own sessions only (never asked on).
"""

from __future__ import annotations

import asyncio

import grpc
import structlog

from stargrpc.errors import RequestError, Unavailable
from stargrpc.principal import Principal
from stargrpc.sessions.forwarding import SessionForwarder
from stargrpc.v1 import tool_service_pb2

log = structlog.get_logger("stargrpc.sessions")

#: Ids of one principal's sessions read from the fleet's index at most.
MAX_LISTED = 1000
#: Longest another replica is given to list its sessions of the caller.
ASK_SECONDS = 5.0


async def fleet_sessions(forwarder: SessionForwarder,
                         request: tool_service_pb2.ListSessionsRequest,
                         principal: Principal, context: grpc.aio.ServicerContext, *,
                         redis_timeout: float) -> list[tool_service_pb2.Session]:
    """``principal``'s sessions that other replicas of the fleet hold, each as its holder
    describes it (in no order).

    Args:
        forwarder: This replica's forwarder (its directory, its assertions).
        request: The caller's request, sent on as it is.
        principal: The caller, authenticated here.
        context: The caller's call (its deadline, trace context and peer).
        redis_timeout: Seconds the read of the fleet's index may take.

    Raises:
        Unavailable: The fleet's Redis did not answer in time.
    """
    directory = forwarder.directory
    try:
        async with asyncio.timeout(redis_timeout):
            held = await directory.listed(principal.id, MAX_LISTED)
    except Exception as exc:  # redis-py's errors, or the bound
        log.warning("sessions_index_unreadable", exc_info=True)
        raise Unavailable("the fleet's store cannot be reached to list the sessions of "
                          "the other replicas", retry_after=1.0) from exc
    # Each replica's answer is kept to what the index lists it as holding: what a call
    # through this replica can reach (a session whose lease lapsed is refused SESSION_LOST
    # here, even while its holder keeps it).
    where: dict[str, set[str]] = {}
    for session_id, owner in held:
        if owner.replica != directory.address:
            where.setdefault(owner.replica, set()).add(session_id)
    replicas = sorted(where)
    if not replicas:
        return []
    if forwarder.assertions is None:
        log.warning("sessions_elsewhere_not_listed", replicas=len(replicas),
                    reason="fleet_secret is not set: other replicas cannot be asked")
        return []

    async def ask(replica: str) -> list[tool_service_pb2.Session]:
        try:
            reply = await forwarder.unary(replica, "ListSessions", request,
                                          tool_service_pb2.ListSessionsResponse, principal,
                                          context, within=ASK_SECONDS)
        except (grpc.aio.AioRpcError, RequestError) as error:
            log.warning("sessions_elsewhere_not_listed", replica=replica,
                        error=str(error)[:200])
            return []
        return [s for s in reply.sessions if s.session_id in where[replica]]

    answers = await asyncio.gather(*(ask(replica) for replica in replicas))
    return [session for answer in answers for session in answer]
