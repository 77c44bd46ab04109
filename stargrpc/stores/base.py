"""What every run store offers: per-run event logs with a gapless ``seq``, run owners and
idempotency claims (the protocols :class:`RunLog` and :class:`RunStore`, and the values they
trade in).

The Execute stream, WatchRun streams and idempotent replays all read a run through its log,
so a run can outlive the stream that started it. :mod:`stargrpc.stores.memory` is the
embedded default; :mod:`stargrpc.stores.redis` implements the same protocols for a fleet of
replicas sharing Redis.

A store holds three things: the run logs, who owns each run (only the owner, or a role with
watch rights, may watch or cancel it), and idempotency claims — ``(principal, key)`` →
the run that key started, with a fingerprint of the tool and arguments it was used for.

Events are kept as ``RunEvent`` protobuf messages rather than a parallel Python model: they
are built once, stored once and sent as they are, which keeps the per-event cost low.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import os
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass
from typing import Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from google.protobuf.timestamp_pb2 import Timestamp

from stargrpc.errors import (
    FailedPrecondition,
    FieldViolation,
    InvalidArgument,
    reason_name,
)
from stargrpc.v1 import errors_pb2, events_pb2

#: Largest serialised event a :class:`MemoryRunLog` keeps the bytes of (file chunks are
#: larger, and serialising them costs little beside sending them).
ENCODED_KEEP_BYTES = 16 * 1024


def stamp_now(timestamp: Timestamp) -> None:
    """Sets ``timestamp`` to now.

    ``Timestamp.GetCurrentTime()`` goes through ``datetime`` in Python; this is the same
    value from one ``time.time_ns()``, and it runs for every event.
    """
    timestamp.seconds, timestamp.nanos = divmod(time.time_ns(), 1_000_000_000)


class EventBatches(Protocol):
    """What :meth:`RunLog.follow_batches` gives: an async iterator of the batches with
    ``aclose`` (an async generator is one; so is :class:`stargrpc.stores.memory.Batches`)."""

    def __aiter__(self) -> AsyncIterator[Sequence[events_pb2.RunEvent]]: ...

    def __anext__(self) -> Awaitable[Sequence[events_pb2.RunEvent]]: ...

    def aclose(self) -> Awaitable[None]:
        """Lets go of whatever the follower holds."""
        ...


class RunLog(Protocol):
    """The event log of one run.

    Attributes:
        run_id: The run.
        owner: The id of the principal the run belongs to.
        tool: The tool being run.
        parent_run_id: The run it hangs under; empty for a top-level run.
        root_run_id: The root of its call tree; empty for a top-level run (its own id).
        depth: Its depth below the root (0 at the top).
        lane: The lane the run runs in, and ``priority`` its priority there (set by the
            runtime when it admits the run; empty on a log read from another replica).
    """

    run_id: str
    owner: str
    tool: str
    parent_run_id: str
    root_run_id: str
    depth: int
    lane: str
    priority: int

    @property
    def finished(self) -> bool:
        """Whether the Result has been appended."""
        ...

    @property
    def last_seq(self) -> int:
        """The seq of the newest event, 0 when empty."""
        ...

    async def append(self, event: events_pb2.RunEvent) -> events_pb2.RunEvent:
        """Stamps ``run_id``, ``seq`` and ``time`` on ``event`` and stores it.

        Raises:
            RuntimeError: The log already holds its Result.
        """
        ...

    def append_nowait(self, event: events_pb2.RunEvent) -> events_pb2.RunEvent:
        """:meth:`append` without a suspension point: how a run appends its events (one
        per event on the hot path, no coroutine each; appended in the order they are made,
        so that a steering notice lands in the log before the tool can act on it). A log
        that writes elsewhere keeps the event and sends it on in the background.

        Raises:
            RuntimeError: The log already holds its Result, or is not written by this
                process.
        """
        ...

    def follow(self, after_seq: int = 0, *, max_lag: int = 0
               ) -> AsyncIterator[events_pb2.RunEvent]:
        """Yields the events after ``after_seq``, then new ones as they come, until the Result.

        Args:
            after_seq: Replay from the event after this one.
            max_lag: When non-zero, a follower that had caught up with the live run and then
                fell more than this many events behind ends with :class:`WatcherTooSlow`.
        """
        ...

    def follow_batches(self, after_seq: int = 0, *, max_lag: int = 0) -> EventBatches:
        """As :meth:`follow`, but yields every event waiting at once, in order: what a
        stream that fell behind its run may send as fewer messages."""
        ...

    def encoded(self, seq: int) -> bytes:
        """The serialised bytes of event ``seq`` of the latest batch this log yielded (a log
        that keeps them need not serialise an event again for each stream).

        Raises:
            IndexError: The log has no bytes for that event.
        """
        ...


@dataclass(frozen=True)
class Claim:
    """The answer to an idempotency claim.

    Attributes:
        run_id: The run the key belongs to: the caller's own when it ``won``.
        fingerprint: What the key was first used for (tool and arguments).
        won: Whether the caller's run now holds the key (and must run).
    """

    run_id: str
    fingerprint: str
    won: bool


@dataclass(frozen=True)
class RunSummary:
    """One run as ListRuns shows it.

    Attributes:
        run_id: The run.
        owner: The id of the principal it belongs to.
        tool: The tool being run.
        started_ms: When it was created, in ms since the epoch.
        finished: Whether its Result has been sent.
        outcome: The Result's ``events_pb2.Outcome`` value, 0 while it runs.
        ended_ms: When its Result was sent, in ms since the epoch; 0 while it runs or when
            unknown.
        last_seq: The seq of its newest event the store knows of.
        current_step: The title of the step running now; empty when none.
        parent_run_id: The run it hangs under; empty for a top-level run.
        root_run_id: The root of its call tree; empty for a top-level run.
        depth: Its depth below the root.
        lane: The lane it runs (or ran, or waits) in; empty when the store does not know
            it yet.
        priority: Its priority in that lane.
    """

    run_id: str
    owner: str
    tool: str
    started_ms: int
    finished: bool = False
    outcome: int = 0
    ended_ms: int = 0
    last_seq: int = 0
    current_step: str = ""
    parent_run_id: str = ""
    root_run_id: str = ""
    depth: int = 0
    lane: str = ""
    priority: int = 0

    @property
    def tree_root(self) -> str:
        """The root of the run's call tree: its own id for a top-level run."""
        return self.root_run_id or self.run_id

    @property
    def position(self) -> tuple[int, str]:
        """Where the run sorts in a listing: newest first, then by id."""
        return (self.started_ms, self.run_id)


@dataclass(frozen=True)
class RunQuery:
    """Which runs a listing wants.

    Attributes:
        owner: Only the runs of this principal; None for every principal's.
        limit: Most runs in the page.
        after: Only runs that sort after this :attr:`RunSummary.position` (the previous
            page's cursor); None from the newest.
        tool: Only runs of this tool; empty for any.
        finished: Only finished (True) or running (False) runs; None for both.
        outcome: Only runs that ended with this outcome; 0 for any.
        root_run_id: Only the runs of this call tree (its root included); empty for any.
        parent_run_id: Only the children of this run; empty for any.
        lane: Only the runs of this lane; empty for any.
    """

    owner: str | None
    limit: int
    after: tuple[int, str] | None = None
    tool: str = ""
    finished: bool | None = None
    outcome: int = 0
    root_run_id: str = ""
    parent_run_id: str = ""
    lane: str = ""

    def admits(self, run: RunSummary) -> bool:
        """Whether ``run`` passes the filters (not the cursor)."""
        return ((self.owner is None or run.owner == self.owner)
                and (not self.tool or run.tool == self.tool)
                and (self.finished is None or run.finished == self.finished)
                and (not self.outcome or run.outcome == self.outcome)
                and (not self.root_run_id or run.tree_root == self.root_run_id)
                and (not self.parent_run_id or run.parent_run_id == self.parent_run_id)
                and (not self.lane or run.lane == self.lane))

    def is_after_cursor(self, position: tuple[int, str]) -> bool:
        """Whether a run at ``position`` comes after the cursor (newest first)."""
        return self.after is None or position < self.after


@dataclass(frozen=True)
class RunPage:
    """A page of a listing.

    Attributes:
        runs: Newest first.
        cursor: Where the next page starts; None when no run is left.
    """

    runs: list[RunSummary]
    cursor: tuple[int, str] | None


#: Bytes of a page token's MAC (HMAC-SHA-256, cut): enough that guessing one is hopeless.
PAGE_TOKEN_MAC_BYTES = 16
#: A page token sealed with AES-GCM starts so (an earlier version's signed one never does:
#: it starts with base64url of "[").
_SEALED_PREFIX = "s1."
_PAGE_TOKEN_NONCE_BYTES = 12
_PAGE_TOKEN_AAD = b"stargrpc page token"

#: Largest start time (ms) a cursor may hold: a signed 64-bit number, as Redis scores and
#: every store's arithmetic expect.
_MAX_CURSOR_MS = 2**63 - 1


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _page_mac(key: bytes, payload: str) -> bytes:
    return hmac.new(key, b"stargrpc page token\0" + payload.encode(),
                    hashlib.sha256).digest()[:PAGE_TOKEN_MAC_BYTES]


def _page_cipher(key: bytes) -> AESGCM:
    return AESGCM(hmac.new(key, b"stargrpc page token cipher", hashlib.sha256).digest())


def encode_page_token(cursor: tuple[int, str] | None, key: bytes) -> str:
    """The opaque page token for ``cursor`` (empty for None), sealed with ``key`` (the
    store's :meth:`RunStore.page_token_key`) so that only tokens this fleet made are
    taken back, and so that a token tells nothing: its cursor is the page's last run
    *listed* before the filters, which the caller may not see (an approver's page of runs
    that wait for approval is cut from every principal's runs)."""
    if cursor is None:
        return ""
    nonce = os.urandom(_PAGE_TOKEN_NONCE_BYTES)
    sealed = _page_cipher(key).encrypt(
        nonce, json.dumps(list(cursor), separators=(",", ":")).encode(), _PAGE_TOKEN_AAD)
    return _SEALED_PREFIX + _b64(nonce + sealed)


def decode_page_token(token: str, key: bytes) -> tuple[int, str] | None:
    """The cursor of a page token from :func:`encode_page_token` with the same ``key`` (or
    a signed one of earlier versions, whose cursor showed).

    Raises:
        InvalidArgument: The token is not one this server (or a replica sharing its store)
            made: garbled, hand-made, or from before tokens were signed.
    """
    if not token:
        return None
    try:
        if token.startswith(_SEALED_PREFIX):
            raw = _unb64(token[len(_SEALED_PREFIX):])
            plain = _page_cipher(key).decrypt(raw[:_PAGE_TOKEN_NONCE_BYTES],
                                              raw[_PAGE_TOKEN_NONCE_BYTES:], _PAGE_TOKEN_AAD)
        else:
            payload, _, mac = token.partition(".")
            if not hmac.compare_digest(_unb64(mac), _page_mac(key, payload)):
                raise ValueError("not signed with this store's key")
            plain = _unb64(payload)
        started, run_id = json.loads(plain)
        if type(started) is not int or not 0 <= started <= _MAX_CURSOR_MS \
                or not isinstance(run_id, str):
            raise ValueError("not a cursor")
    except (ValueError, TypeError, binascii.Error, InvalidTag) as exc:
        raise InvalidArgument("the page token is not valid", [FieldViolation(
            "page_token", "not a token from next_page_token; start again without one")]
        ) from exc
    return (started, run_id)


class CancelHandler(Protocol):
    """Stops a run of this process; whether it was still going."""

    def __call__(self, run_id: str, reason: str, failure_code: str = "") -> bool:
        """Ends the run ``Result{CANCELLED}`` with ``reason``, or ``Result{ERROR,
        failure_code}`` when a failure code is given (the store cannot keep the run)."""
        ...


class SteerHandler(Protocol):
    """Steers a run of this process; whether it runs here."""

    def __call__(self, run_id: str, message: str, source: str) -> bool:
        """Hands ``message`` to the run (see :meth:`stargrpc.runs.run.Run.steer`, whose refusals
        it raises); False when no such run is going in this process."""
        ...


class RunStore(Protocol):
    """Where run logs, their owners and idempotency claims live.

    Attributes:
        cancel_handler: Set by the runtime: stops a run of this process, given its id and
            the reason, and says whether it was still going.
        steer_handler: Set by the runtime: steers a run of this process.
    """

    cancel_handler: CancelHandler | None
    steer_handler: SteerHandler | None

    def create(self, run_id: str, owner: str = "", tool: str = "") -> RunLog:
        """A new, empty log for ``run_id``, owned by principal ``owner``."""
        ...

    async def open(self, run_id: str) -> RunLog | None:
        """The log of ``run_id`` wherever the run lives, or None when unknown or expired.

        Raises:
            Unavailable: A shared store is unreachable.
        """
        ...

    async def publish(self, log: RunLog) -> None:
        """Makes a new run visible to every replica: before it starts when it then wins an
        idempotency claim (the claim registers it), else with its first events (a shared
        store writes the run and its first batch in one go, off the call's critical path).

        Raises:
            Unavailable: A shared store is unreachable.
        """
        ...

    async def register(self, log: RunLog) -> None:
        """Makes a published run known to every replica now, before it starts, rather than
        with its first events: a run whose Result another replica may have to deliver must
        be found there (and ended ``RUN_LOST`` if its replica dies) the moment its call is
        answered. Does nothing to a run its claim registered, or in one process.

        Raises:
            Unavailable: A shared store is unreachable (the run must not start).
        """
        ...

    async def claim(self, owner: str, key: str, fingerprint: str, log: RunLog) -> Claim:
        """Claims idempotency key ``key`` of ``owner`` for the run of ``log``, or returns the
        run that holds it (an unfinished run whose replica died loses its claim).

        Raises:
            Unavailable: A shared store is unreachable.
        """
        ...

    async def discard(self, log: RunLog) -> None:
        """Forgets a published run that will not start after all (it lost its claim)."""
        ...

    async def request_cancel(self, run_id: str, reason: str) -> bool:
        """Asks the replica running ``run_id`` to cancel it.

        Returns:
            Whether the run was still going.
        """
        ...

    async def request_steer(self, run_id: str, message: str, source: str) -> None:
        """Hands a steering message to the run ``run_id`` wherever it runs.

        Raises:
            FailedPrecondition: The run has ended (reason RUN_FINISHED).
            ResourceExhausted: The run holds too many unread steering messages.
            Unavailable: A shared store is unreachable.
        """
        ...

    async def aclose(self) -> None:
        """Releases connections and background tasks."""
        ...

    async def list_runs(self, query: RunQuery) -> RunPage:
        """The runs ``query`` asks for, newest first, on every replica.

        Raises:
            Unavailable: A shared store is unreachable.
        """
        ...

    async def page_token_key(self) -> bytes:
        """The secret ListRuns page tokens are signed with: the same for every replica
        sharing this store (so a page asked of one continues on another), unknown to
        callers.

        Raises:
            Unavailable: A shared store is unreachable.
        """
        ...

    async def count_tree_runs(self, root_run_id: str, delta: int, ttl_ms: int) -> int | None:
        """Adds ``delta`` to the runs the call tree of ``root_run_id`` has started on every
        replica, and returns the new count (the count goes ``ttl_ms`` after its last
        change); None for a store of one process, where the runtime's own count is the
        tree's.

        Raises:
            Unavailable: A shared store is unreachable.
        """
        ...


def run_finished_error(run_id: str) -> FailedPrecondition:
    """The refusal of a request that needs a run still going (steering it)."""
    return FailedPrecondition("the run has ended; it cannot be steered",
                              reason=reason_name(errors_pb2.RUN_FINISHED),
                              metadata={"run_id": run_id})


# -- run state (ctx.state) ------------------------------------------------------------------

#: What a state write can answer besides a value: written, the expected value was not there
#: (compare_and_set), the scope's quota would be exceeded, or the value to increment is no
#: integer.
STATE_WRITTEN = "written"
STATE_MISMATCH = "mismatch"
STATE_OVER_QUOTA = "quota"
STATE_NOT_INTEGER = "not_integer"


@dataclass(frozen=True)
class StateWrite:
    """How a state write goes.

    Attributes:
        scope_ttl_ms: The TTL the scope's keys get with this write (0: none) — the bound on
            the state of a run or tree still going.
        max_scope_bytes: The scope's quota: bytes of keys and values together (0: none).
        ttl_ms: The entry's own TTL (0: none).
    """

    scope_ttl_ms: int = 0
    max_scope_bytes: int = 0
    ttl_ms: int = 0


class StateStore(Protocol):
    """Where tools keep state between calls (``ctx.state(scope)``), one namespace per scope
    key (``run:<id>``, ``tree:<root id>``, ``principal:<id>``, ``global``).

    Values are canonical JSON text (the caller encodes them, so equal values are equal
    strings); the store compares them as strings. Each method is atomic on its own: two
    replicas writing one key see :meth:`put` with ``expected`` succeed for exactly one.
    """

    async def get(self, scope: str, key: str) -> str | None:
        """The value of ``key``, None when absent or expired."""
        ...

    async def put(self, scope: str, key: str, value: str, write: StateWrite, *,
                  conditional: bool = False, expected: str | None = None) -> str:
        """Sets ``key`` to ``value``; with ``conditional``, only if its value is ``expected``
        (None: absent). Returns :data:`STATE_WRITTEN`, :data:`STATE_MISMATCH` or
        :data:`STATE_OVER_QUOTA`."""
        ...

    async def increment(self, scope: str, key: str, by: int,
                        write: StateWrite) -> int | str:
        """Adds ``by`` to the integer at ``key`` (absent counts as 0) and returns the new
        value, or :data:`STATE_NOT_INTEGER` / :data:`STATE_OVER_QUOTA`."""
        ...

    async def delete(self, scope: str, key: str) -> bool:
        """Removes ``key``; whether it was there."""
        ...

    async def keys(self, scope: str, prefix: str) -> list[str]:
        """The live keys starting with ``prefix``, sorted."""
        ...

    async def end_scope(self, scope: str, retention_ms: int) -> None:
        """The run or tree of ``scope`` ended: its state goes ``retention_ms`` from now."""
        ...
