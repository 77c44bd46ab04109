"""Redis failures, and the one table that says what a caller is told for each.

Every Redis call of the store runs inside :func:`reachable` (or, for a deadline of the
store's own, ends in :func:`request_error`): the failure is logged once and becomes a
:class:`~stargrpc.errors.RequestError` — UNAVAILABLE with RetryInfo, whose reason says
whether Redis could not be reached (``RUN_STORE_UNAVAILABLE``: retry shortly) or answered
with an error (``RUN_STORE_FAILED``). :data:`FAILURES` is that mapping, first match wins::

    NotReplicated                     RUN_STORE_UNAVAILABLE  not confirmed on its replicas
    ConnectionError, TimeoutError     RUN_STORE_UNAVAILABLE  unreachable
      (redis-py's)
    SLOT_MOVING (TRYAGAIN, MOVED,     RUN_STORE_UNAVAILABLE  a Redis Cluster moving the slot
      ASK, CLUSTERDOWN)
    TimeoutError (the store's own     RUN_STORE_UNAVAILABLE  did not answer in time
      deadline), ClaimTooLate
    KeyVanished                       RUN_STORE_UNAVAILABLE  a key it wrote is gone
    RedisError (any other)            RUN_STORE_FAILED       Redis answered with an error
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import structlog
from redis.exceptions import (
    AskError,
    ClusterError,
    RedisClusterException,
    RedisError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from stargrpc.errors import RequestError, Unavailable

log = structlog.get_logger("stargrpc.stores.redis")

#: The RetryInfo delay of a call refused because Redis did not answer.
RETRY_AFTER_SECONDS = 1.0
#: What a Redis Cluster answers while a slot moves (or fails over): TRYAGAIN (a multi-key
#: script whose keys are split between two nodes, or not all there), a MOVED or ASK left
#: over, CLUSTERDOWN, and redis-py's "TTL exhausted" after it retried those for a while.
#: Redis is up; the command is to be sent again shortly.
SLOT_MOVING = (TryAgainError, AskError, ClusterError)


class NotReplicated(RedisTimeoutError):
    """Redis applied a write, but fewer replicas than ``redis_wait_replicas`` acknowledged
    it in ``redis_wait_timeout_ms``: it counts as failed (and is repeated, or the call fails
    UNAVAILABLE), since a failover could still lose it."""


class ClaimTooLate(Exception):
    """Redis answered that the call's deadline (by its clock) passed before the claim
    reached it. No OSError, unlike a TimeoutError: no Redis failure, and not reported as
    one by :func:`as_redis_error`."""


class KeyVanished(Exception):
    """A key the store had just written was gone when it read it back (removed in
    between); its message names the key's purpose."""


@dataclass(frozen=True)
class Failure:
    """One row of :data:`FAILURES`.

    Attributes:
        kinds: The exception types the row matches.
        reason: The error reason the caller is told.
        message: What the caller is told; ``{action}`` and ``{error}`` are filled in.
        detail: The ``error`` field of the log line (``{error}``: the exception's text).
        level: How the failure is logged (``redis_unavailable`` as a warning, or
            ``redis_failed`` as an error); empty: not logged.
    """

    kinds: tuple[type[BaseException], ...]
    reason: str
    message: str
    detail: str = "{error}"
    level: str = "warning"


#: Redis failures → what the caller is told; the first row whose kinds match.
FAILURES: tuple[Failure, ...] = (
    Failure((NotReplicated,), "RUN_STORE_UNAVAILABLE",
            "the shared run store (Redis) did not confirm the write on its replicas "
            "({action}: {error}); retry shortly"),
    Failure((RedisConnectionError, RedisTimeoutError), "RUN_STORE_UNAVAILABLE",
            "the shared run store (Redis) is unreachable ({action}); retry shortly"),
    Failure(SLOT_MOVING, "RUN_STORE_UNAVAILABLE",
            "the shared run store (Redis Cluster) is moving or failing over this run's slot "
            "({action}); retry shortly", detail="slot moving: {error}"),
    Failure((TimeoutError,), "RUN_STORE_UNAVAILABLE",
            "the shared run store (Redis) did not answer in time ({action}); retry shortly",
            detail="no answer in time"),
    Failure((ClaimTooLate,), "RUN_STORE_UNAVAILABLE",
            "the shared run store (Redis) did not answer in time ({action}); retry shortly",
            detail="the call's deadline passed before Redis took the claim"),
    Failure((KeyVanished,), "RUN_STORE_UNAVAILABLE", "the shared run store lost {error}; retry",
            level=""),
    Failure((RedisError,), "RUN_STORE_FAILED",
            "the shared run store (Redis) failed ({action}); retry shortly", level="error"),
)


def request_error(exc: BaseException, action: str, *, detail: str | None = None
                  ) -> RequestError:
    """What a caller is told of ``exc`` met while ``action``, by :data:`FAILURES`; logs it.

    Args:
        exc: The failure.
        action: What the store was doing, as the caller reads it ("claiming the idempotency
            key").
        detail: The log line's ``error`` instead of the row's.

    Raises:
        TypeError: ``exc`` is none of the table's kinds (a bug of the caller's).
    """
    for row in FAILURES:
        if isinstance(exc, row.kinds):
            error = str(exc)
            said = detail if detail is not None else row.detail.format(error=error)
            if row.level == "warning":
                log_unavailable(action, said)
            elif row.level == "error":
                log.error("redis_failed", action=action, error=said)
            return Unavailable(row.message.format(action=action, error=error),
                               reason=row.reason, retry_after=RETRY_AFTER_SECONDS)
    raise TypeError(f"no Redis failure: {type(exc).__name__}") from exc


def log_unavailable(action: str, error: str) -> None:
    """The log line of a call that Redis failed."""
    log.warning("redis_unavailable", action=action, error=error)


@contextlib.contextmanager
def as_redis_error() -> Iterator[None]:
    """Reports what redis-py's cluster client raises on a connection torn down under it (a
    node killed mid-command: an AttributeError on the closed writer, an OSError), or when no
    node of the cluster answers (a RedisClusterException, which is no RedisError), as the
    connection error it is; a bare TimeoutError (an OSError too) as the timeout it is.

    Only around redis-py's calls: a deadline of the store's own (``asyncio.timeout``)
    is kept outside, or its TimeoutError would be reported as Redis's."""
    try:
        yield
    except TimeoutError as exc:  # no answer in time: the connection may well be fine
        raise RedisTimeoutError(f"no answer in time ({exc or 'timed out'})") from exc
    except (AttributeError, OSError) as exc:
        raise RedisConnectionError(f"connection lost ({type(exc).__name__}: {exc})") from exc
    except RedisClusterException as exc:  # no node reachable, or no node serving a slot
        raise RedisConnectionError(f"Redis Cluster unreachable ({exc})") from exc


@contextlib.contextmanager
def reachable(action: str) -> Iterator[None]:
    """Turns a Redis failure into the :class:`~stargrpc.errors.RequestError`
    :data:`FAILURES` gives for it, with a message a caller can act on."""
    try:
        with as_redis_error():
            yield
    except RedisError as exc:
        raise request_error(exc, action) from exc


def check_acknowledged(replies: list[Any], replicas: int, timeout_ms: int) -> None:
    """Raises :class:`NotReplicated` unless every WAIT reply counts ``replicas``."""
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
        if int(reply) < replicas:
            raise NotReplicated(f"{reply} of {replicas} Redis replicas acknowledged the write "
                                f"within {timeout_ms} ms (redis_wait_replicas)")
