"""Per-run event logs: every event of a run, in order, with a gapless ``seq``.

The Execute stream, WatchRun streams and idempotent replays all read a run through its log,
so a run can outlive the stream that started it. :class:`MemoryRunStore` is the embedded
default; :class:`stargrpc.stores.redis.RedisRunStore` implements the same protocols for a
fleet of replicas sharing Redis.

A store holds three things: the run logs, who owns each run (only the owner, or a role with
watch rights, may watch or cancel it), and idempotency claims — ``(principal, key)`` →
the run that key started, with a fingerprint of the tool and arguments it was used for.

Events are kept as ``RunEvent`` protobuf messages rather than a parallel Python model: they
are built once, stored once and sent as they are, which keeps the per-event cost low.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Protocol

from google.protobuf.timestamp_pb2 import Timestamp

from stargrpc.errors import (
    FailedPrecondition,
    FieldViolation,
    InvalidArgument,
    WatcherTooSlow,
    reason_name,
)
from stargrpc.v1 import errors_pb2, events_pb2

#: Largest serialised event a :class:`MemoryRunLog` keeps the bytes of (file chunks are
#: larger, and serialising them costs little beside sending them).
ENCODED_KEEP_BYTES = 16 * 1024


def stamp_now(timestamp: Timestamp) -> None:
    """Sets ``timestamp`` to now.

    ``Timestamp.GetCurrentTime()`` goes through ``datetime`` in Python (6-8 µs); this is the
    same value from one ``time.time_ns()`` (about 1 µs), and it runs for every event.
    """
    timestamp.seconds, timestamp.nanos = divmod(time.time_ns(), 1_000_000_000)


class RunLog(Protocol):
    """The event log of one run.

    Attributes:
        run_id: The run.
        owner: The id of the principal the run belongs to.
        tool: The tool being run.
    """

    run_id: str
    owner: str
    tool: str

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

    def follow(self, after_seq: int = 0, *, max_lag: int = 0
               ) -> AsyncIterator[events_pb2.RunEvent]:
        """Yields the events after ``after_seq``, then new ones as they come, until the Result.

        Args:
            after_seq: Replay from the event after this one.
            max_lag: When non-zero, a follower that had caught up with the live run and then
                fell more than this many events behind ends with :class:`WatcherTooSlow`.
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
    """

    owner: str | None
    limit: int
    after: tuple[int, str] | None = None
    tool: str = ""
    finished: bool | None = None
    outcome: int = 0

    def admits(self, run: RunSummary) -> bool:
        """Whether ``run`` passes the filters (not the cursor)."""
        return ((self.owner is None or run.owner == self.owner)
                and (not self.tool or run.tool == self.tool)
                and (self.finished is None or run.finished == self.finished)
                and (not self.outcome or run.outcome == self.outcome))

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


def encode_page_token(cursor: tuple[int, str] | None) -> str:
    """The opaque page token for ``cursor`` (empty for None)."""
    if cursor is None:
        return ""
    return base64.urlsafe_b64encode(json.dumps(list(cursor)).encode()).decode().rstrip("=")


def decode_page_token(token: str) -> tuple[int, str] | None:
    """The cursor of a page token from :func:`encode_page_token`.

    Raises:
        InvalidArgument: The token is not one this server made.
    """
    if not token:
        return None
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        started, run_id = json.loads(raw)
        if not isinstance(started, int) or not isinstance(run_id, str):
            raise ValueError("not a cursor")
    except (ValueError, TypeError, binascii.Error) as exc:
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
        """Hands ``message`` to the run (see :meth:`stargrpc.run.Run.steer`, whose refusals
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


def run_finished_error(run_id: str) -> FailedPrecondition:
    """The refusal of a request that needs a run still going (steering it)."""
    return FailedPrecondition("the run has ended; it cannot be steered",
                              reason=reason_name(errors_pb2.RUN_FINISHED),
                              metadata={"run_id": run_id})


class MemoryRunLog:
    """A run log held in this process."""

    run_id: str
    owner: str
    tool: str
    _events: list[events_pb2.RunEvent]
    _encoded: list[bytes | None]
    _wakeup: asyncio.Event | None
    _waiting: int
    _finished: bool
    finished_at: float | None
    size: int
    started_ms: int
    ended_ms: int
    outcome: int
    _open_steps: dict[str, str]

    def __init__(self, run_id: str,
                 on_finish: Callable[[MemoryRunLog], None] | None = None, *,
                 owner: str = "", tool: str = "") -> None:
        self.run_id = run_id
        self.owner = owner
        self.tool = tool
        self._on_finish = on_finish
        self._events = []
        self._encoded = []
        self._wakeup = None  # made by the first follower that waits
        self._waiting = 0  # followers waiting on _wakeup
        self._finished = False
        self.finished_at = None
        self.size = 0
        self.started_ms = time.time_ns() // 1_000_000
        self.ended_ms = 0
        self.outcome = 0
        # Steps started and not ended, by id, oldest first: the last is the current one.
        self._open_steps = {}

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def current_step(self) -> str:
        """The title of the most recently started step that has not ended; empty if none."""
        return next(reversed(self._open_steps.values()), "")

    def summary(self) -> RunSummary:
        """The run as ListRuns shows it."""
        return RunSummary(self.run_id, self.owner, self.tool, self.started_ms,
                          finished=self._finished, outcome=self.outcome,
                          ended_ms=self.ended_ms, last_seq=len(self._events),
                          current_step=self.current_step)

    @property
    def last_seq(self) -> int:
        return len(self._events)

    async def append(self, event: events_pb2.RunEvent) -> events_pb2.RunEvent:
        return self.append_nowait(event)

    def append_nowait(self, event: events_pb2.RunEvent) -> events_pb2.RunEvent:
        """:meth:`append` without a suspension point, for callers on the event loop."""
        if self._finished:
            raise RuntimeError(f"run {self.run_id} already has its Result")
        event.run_id = self.run_id
        event.seq = len(self._events) + 1
        if not event.HasField("time"):
            stamp_now(event.time)
        self._events.append(event)
        self._encoded.append(None)
        kind = event.WhichOneof("kind")
        if kind == "step":
            phase = event.step.phase
            if phase == events_pb2.STEP_PHASE_START:
                self._open_steps[event.step.step.id] = event.step.step.title
            elif phase == events_pb2.STEP_PHASE_END:
                self._open_steps.pop(event.step.step.id, None)
        elif kind == "result":
            self._finished = True
            self.outcome = event.result.outcome
            self.ended_ms = event.time.seconds * 1000 + event.time.nanos // 1_000_000
            self._open_steps.clear()
            self.finished_at = time.monotonic()
            # Measured once, at the end, rather than per event on the append path.
            self.size = sum(map(events_pb2.RunEvent.ByteSize, self._events))
            if self._on_finish is not None:
                self._on_finish(self)
        if self._waiting:
            # Wake every follower waiting on the current event; later waiters make a fresh
            # one: a follower never misses a wake-up between checking and waiting.
            # Followers that are behind are not waiting, and then this is skipped (it costs
            # as much as the rest of an append).
            wakeup, self._wakeup = self._wakeup, None
            if wakeup is not None:
                wakeup.set()
        return event

    def encoded(self, seq: int) -> bytes:
        """The serialised bytes of event ``seq``: made once, on first request, then shared by
        every reader (an event in the log is never changed again). Bytes of events over
        :data:`ENCODED_KEEP_BYTES` are made again for each reader instead of being kept
        twice (the event and its bytes) for as long as the log is retained.

        Raises:
            IndexError: No such event.
        """
        if not 0 < seq <= len(self._events):
            raise IndexError(f"run {self.run_id} has no event {seq}")
        data = self._encoded[seq - 1]
        if data is None:
            data = self._events[seq - 1].SerializeToString()
            if len(data) <= ENCODED_KEEP_BYTES:
                self._encoded[seq - 1] = data
        return data

    async def follow(self, after_seq: int = 0, *, max_lag: int = 0
                     ) -> AsyncIterator[events_pb2.RunEvent]:
        async with aclosing(self.follow_batches(after_seq, max_lag=max_lag)) as batches:
            async for batch in batches:
                for event in batch:
                    yield event

    async def follow_batches(self, after_seq: int = 0, *, max_lag: int = 0
                             ) -> AsyncGenerator[Sequence[events_pb2.RunEvent], None]:
        """As :meth:`follow`, but yields every event waiting at once: all the events
        appended since the previous batch was taken, in order."""
        position = max(0, after_seq)
        caught_up = False
        while True:
            if position < len(self._events):
                lag = len(self._events) - position
                # Only a follower that had been live and fell back is too slow; one
                # replaying a long run from the start is not.
                if max_lag and caught_up and lag > max_lag and not self._finished:
                    raise WatcherTooSlow(self.run_id, position, lag)
                batch = self._events[position:]
                position += len(batch)
                yield batch
                continue
            if self._finished:
                return
            caught_up = True
            wakeup = self._wakeup
            if wakeup is None:
                wakeup = self._wakeup = asyncio.Event()
            self._waiting += 1
            try:
                await wakeup.wait()
            finally:
                self._waiting -= 1


class MemoryRunStore:
    """Run logs and idempotency claims in memory, for one process.

    A finished run is dropped ``retention`` seconds after its Result, or earlier (oldest
    first) while more than ``max_finished`` finished runs are kept or their events come to
    more than ``max_finished_bytes`` (serialised; 0 = no bound); its idempotency claim goes
    with it.
    """

    retention: float
    max_finished: int
    max_finished_bytes: int
    finished_bytes: int
    _logs: dict[str, MemoryRunLog]
    _finished: deque[tuple[float, str, int]]
    _claims: dict[tuple[str, str], tuple[str, str]]
    _claim_of_run: dict[str, tuple[str, str]]
    cancel_handler: CancelHandler | None
    steer_handler: SteerHandler | None

    def __init__(self, retention: float = 600.0, max_finished: int = 10_000,
                 max_finished_bytes: int = 256 * 1024 * 1024) -> None:
        self.retention = retention
        self.max_finished = max_finished
        self.max_finished_bytes = max_finished_bytes
        self.finished_bytes = 0  # of the finished runs kept
        self._logs = {}
        self._finished = deque()
        self._claims = {}
        self._claim_of_run = {}
        # Set by the runtime: stops a run of this process (run_id, reason) -> was running.
        self.cancel_handler = None
        self.steer_handler = None

    def create(self, run_id: str, owner: str = "", tool: str = "") -> MemoryRunLog:
        self._expire()
        log = MemoryRunLog(run_id, on_finish=self._record_finish, owner=owner, tool=tool)
        self._logs[run_id] = log
        return log

    def get(self, run_id: str) -> MemoryRunLog | None:
        """The log of ``run_id`` (this process only)."""
        self._expire()
        return self._logs.get(run_id)

    async def open(self, run_id: str) -> MemoryRunLog | None:
        return self.get(run_id)

    async def publish(self, log: RunLog) -> None:
        return None  # created logs are already visible to this process

    async def claim(self, owner: str, key: str, fingerprint: str, log: RunLog) -> Claim:
        # No suspension point: check-and-set is atomic on the event loop.
        self._expire()
        held = self._claims.get((owner, key))
        if held is not None and held[1] in self._logs:
            return Claim(run_id=held[1], fingerprint=held[0], won=False)
        self._claims[(owner, key)] = (fingerprint, log.run_id)
        self._claim_of_run[log.run_id] = (owner, key)
        return Claim(run_id=log.run_id, fingerprint=fingerprint, won=True)

    async def discard(self, log: RunLog) -> None:
        self._logs.pop(log.run_id, None)

    async def request_cancel(self, run_id: str, reason: str) -> bool:
        if self.cancel_handler is None:
            return False
        return self.cancel_handler(run_id, reason)

    async def request_steer(self, run_id: str, message: str, source: str) -> None:
        if self.steer_handler is None or not self.steer_handler(run_id, message, source):
            raise run_finished_error(run_id)

    async def aclose(self) -> None:
        return None

    async def list_runs(self, query: RunQuery) -> RunPage:
        self._expire()
        runs: list[RunSummary] = []
        # Logs are kept in creation order: newest first is the dict reversed.
        for log in reversed(self._logs.values()):
            if not query.is_after_cursor((log.started_ms, log.run_id)):
                continue
            if query.owner is not None and log.owner != query.owner:
                continue
            summary = log.summary()
            if query.admits(summary):
                if len(runs) == query.limit:
                    return RunPage(runs, runs[-1].position)
                runs.append(summary)
        return RunPage(runs, None)

    def __len__(self) -> int:
        return len(self._logs)

    def _record_finish(self, log: MemoryRunLog) -> None:
        self._finished.append((log.finished_at or time.monotonic(), log.run_id, log.size))
        self.finished_bytes += log.size
        self._expire()

    def _expire(self) -> None:
        deadline = time.monotonic() - self.retention
        byte_bound = self.max_finished_bytes or float("inf")
        while self._finished and (
            self._finished[0][0] < deadline or len(self._finished) > self.max_finished
            # The newest finished run stays, however large: it is the one most likely
            # to be watched, and runs in flight are not bounded here either.
            or (self.finished_bytes > byte_bound and len(self._finished) > 1)
        ):
            _, run_id, size = self._finished.popleft()
            self.finished_bytes -= size
            self._logs.pop(run_id, None)
            claim_key = self._claim_of_run.pop(run_id, None)
            if claim_key is not None and self._claims.get(claim_key, ("", ""))[1] == run_id:
                del self._claims[claim_key]
