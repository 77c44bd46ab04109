"""The embedded run store: every run's event log, owner and idempotency claims in this
process's memory (:class:`MemoryRunStore`), and the log of one run (:class:`MemoryRunLog`),
which the Redis store builds on.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing, suppress

from stargrpc.errors import WatcherTooSlow
from stargrpc.stores.base import (
    ENCODED_KEEP_BYTES,
    STATE_MISMATCH,
    STATE_NOT_INTEGER,
    STATE_OVER_QUOTA,
    STATE_WRITTEN,
    CancelHandler,
    Claim,
    RunLog,
    RunPage,
    RunQuery,
    RunSummary,
    StateWrite,
    SteerHandler,
    run_finished_error,
    stamp_now,
)
from stargrpc.v1 import events_pb2

_START = events_pb2.STEP_PHASE_START
_END = events_pb2.STEP_PHASE_END


class MemoryRunLog:
    """A run log held in this process."""

    run_id: str
    owner: str
    tool: str
    _events: list[events_pb2.RunEvent]
    _encoded: list[bytes | None]
    _waiters: list[asyncio.Future[None]]
    _finished: bool
    finished_at: float | None
    size: int
    started_ms: int
    ended_ms: int
    outcome: int
    _open_steps: dict[str, str]
    # Where the run sits in its call tree: set on the few runs below a root.
    parent_run_id = ""
    root_run_id = ""
    depth = 0
    # The lane the run runs in and its priority there (set when it is admitted).
    lane = ""
    priority = 0

    def __init__(self, run_id: str,
                 on_finish: Callable[[MemoryRunLog], None] | None = None, *,
                 owner: str = "", tool: str = "") -> None:
        self.run_id = run_id
        self.owner = owner
        self.tool = tool
        self._on_finish = on_finish
        self._events = []
        self._encoded = []
        self._waiters = []  # followers waiting for the next append, each its own future
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
                          current_step=self.current_step, parent_run_id=self.parent_run_id,
                          root_run_id=self.root_run_id, depth=self.depth, lane=self.lane,
                          priority=self.priority)

    @property
    def last_seq(self) -> int:
        return len(self._events)

    async def append(self, event: events_pb2.RunEvent) -> events_pb2.RunEvent:
        return self.append_nowait(event)

    def append_nowait(self, event: events_pb2.RunEvent) -> events_pb2.RunEvent:
        """Stamps ``run_id``, ``seq`` and ``time`` on ``event`` and stores it, without a
        suspension point (:meth:`RunLog.append_nowait`); for callers on the event loop.

        Raises:
            RuntimeError: The log already holds its Result.
        """
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
            message = event.step
            phase = message.phase
            if phase == _START:
                step = message.step
                self._open_steps[step.id] = step.title
            elif phase == _END:
                self._open_steps.pop(message.step.id, None)
        elif kind == "result":
            self._finished = True
            self.outcome = event.result.outcome
            self.ended_ms = event.time.seconds * 1000 + event.time.nanos // 1_000_000
            self._open_steps.clear()
            self.finished_at = time.monotonic()
            # Measured once, at the end, rather than per event on the append path.
            self.size = self._measure()
            if self._on_finish is not None:
                self._on_finish(self)
        if self._waiters:
            # Wake every follower waiting on the current event; later waiters make fresh
            # futures: a follower never misses a wake-up between checking and waiting.
            # Followers that are behind are not waiting, and then this is skipped (it costs
            # as much as the rest of an append).
            waiters, self._waiters = self._waiters, []
            for waiter in waiters:
                if not waiter.done():  # (its follower was cancelled)
                    waiter.set_result(None)
        return event

    def _measure(self) -> int:
        """The serialised size of the events in the log. An event whose bytes are kept
        (a reader asked for them, or the Redis log flushed them) is as long as they are;
        the others are serialised and their bytes kept, as :meth:`encoded` would — the
        run's own stream asks for them next — except the Result, which streams send as a
        message of their own: it is only sized."""
        encoded = self._encoded
        last = len(encoded) - 1
        total = 0
        for index, data in enumerate(encoded):
            if data is None:
                event = self._events[index]
                if index == last:
                    total += event.ByteSize()
                    continue
                data = event.SerializeToString()
                if len(data) <= ENCODED_KEEP_BYTES:
                    encoded[index] = data
            total += len(data)
        return total

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

    def follow_batches(self, after_seq: int = 0, *, max_lag: int = 0) -> Batches:
        """As :meth:`follow`, but yields every event waiting at once: all the events
        appended since the previous batch was taken, in order."""
        return Batches(self, max(0, after_seq), max_lag)

    def _next_append(self) -> asyncio.Future[None]:
        """A future of this follower's own, done with the next append (one each: a follower
        cancelled while it waits cancels only its own)."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        return waiter

    def _stop_waiting(self, waiter: asyncio.Future[None]) -> None:
        with suppress(ValueError):  # (already taken by an append)
            self._waiters.remove(waiter)


class Batches:
    """The batches of one follower of a :class:`MemoryRunLog`
    (:meth:`MemoryRunLog.follow_batches`).

    An async iterator of its own rather than an async generator: every Execute and WatchRun
    stream follows a log, and a generator costs each of them the event loop's bookkeeping
    of async generators (a weak reference kept, a finalizer, ``aclose``) and a frame more on
    every wake-up (``bench/README.md``). ``aclose`` is there for ``contextlib.aclosing``:
    nothing is held between batches.
    """

    __slots__ = ("_caught_up", "_log", "_max_lag", "_position")

    def __init__(self, log: MemoryRunLog, position: int, max_lag: int) -> None:
        self._log = log
        self._position = position
        self._max_lag = max_lag
        self._caught_up = False

    def __aiter__(self) -> Batches:
        return self

    async def __anext__(self) -> Sequence[events_pb2.RunEvent]:
        log = self._log
        while True:
            events = log._events
            position = self._position
            if position < len(events):
                lag = len(events) - position
                # Only a follower that had been live and fell back is too slow; one
                # replaying a long run from the start is not.
                if self._max_lag and self._caught_up and lag > self._max_lag \
                        and not log._finished:
                    raise WatcherTooSlow(log.run_id, position, lag)
                batch = events[position:]
                self._position = position + len(batch)
                return batch
            if log._finished:
                raise StopAsyncIteration
            self._caught_up = True
            waiter = log._next_append()
            try:
                await waiter
            except BaseException:
                # Cancelled (the stream went away): take its future off the log at once,
                # or a quiet run would keep one for every watcher that came and went. (One
                # an append already took is off the list: no scan of the others for it.)
                if waiter.cancelled():
                    log._stop_waiting(waiter)
                raise

    async def aclose(self) -> None:
        """Nothing to release (see the class docstring)."""


class MemoryRunStore:
    """Run logs and idempotency claims in memory, for one process.

    A finished run is dropped ``retention`` seconds after its Result, or earlier (oldest
    first) while more than ``max_finished`` finished runs are kept or their events come to
    more than ``max_finished_bytes`` (serialised; 0 = no bound); its idempotency claim goes
    with it. Its :attr:`state` holds the tools' run state.
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
    state: MemoryStateStore
    _page_token_key: bytes

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
        # Its runs are this process's alone, and so are the tokens that page through them.
        self._page_token_key = secrets.token_bytes(32)
        # Run state (ctx.state) lives beside the runs, as in every store.
        self.state = MemoryStateStore()

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

    async def register(self, log: RunLog) -> None:
        return None  # one process: nobody else looks for the run

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

    async def page_token_key(self) -> bytes:
        return self._page_token_key

    async def count_tree_runs(self, root_run_id: str, delta: int, ttl_ms: int) -> int | None:
        return None  # one process: the runtime's count of each tree is the whole count

    async def list_runs(self, query: RunQuery) -> RunPage:
        self._expire()
        runs: list[RunSummary] = []
        # Newest first in the cursor's own order, (start, run id) descending: the logs' own
        # order (creation) differs from it for runs started in the same millisecond (ids are
        # not ordered within one) or across a step of the clock, and a page's cursor then
        # skipped the runs out of that order.
        for log in sorted(self._logs.values(), key=_position, reverse=True):
            if not query.is_after_cursor((log.started_ms, log.run_id)):
                continue
            if query.owner is not None and log.owner != query.owner:
                continue
            if query.root_run_id and (log.root_run_id or log.run_id) != query.root_run_id:
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


def _position(log: MemoryRunLog) -> tuple[int, str]:
    return (log.started_ms, log.run_id)


class _Scope:
    """One scope's entries: key → (value, expiry by the monotonic clock or None)."""

    __slots__ = ("entries", "expires", "size")

    def __init__(self) -> None:
        self.entries: dict[str, tuple[str, float | None]] = {}
        self.size = 0
        self.expires: float | None = None


#: Largest integer ``increment`` keeps (exact in every store).
_MAX_INTEGER = 2**53 - 1


def _entry_size(key: str, value: str) -> int:
    return len(key.encode()) + len(value.encode())


class MemoryStateStore:
    """Run state in this process (the embedded server's :class:`StateStore`).

    It does not survive a restart: state is a convenience for tools, not a record, and an
    embedded server has nothing to share it with. Every method runs without awaiting
    anything, so each is atomic on the event loop. Expired entries and ended scopes go when
    next touched, and ended scopes also when any scope is written (a sweep of the few whose
    retention runs).
    """

    def __init__(self) -> None:
        self._scopes: dict[str, _Scope] = {}
        self._ending: dict[str, float] = {}

    def _sweep(self, now: float) -> None:
        for name, deadline in list(self._ending.items()):
            if deadline <= now:
                del self._ending[name]
                self._scopes.pop(name, None)

    def _scope(self, name: str, now: float, *, create: bool) -> _Scope | None:
        scope = self._scopes.get(name)
        if scope is not None and scope.expires is not None and scope.expires <= now:
            del self._scopes[name]
            self._ending.pop(name, None)
            scope = None
        if scope is None and create:
            scope = self._scopes[name] = _Scope()
        return scope

    @staticmethod
    def _live(scope: _Scope, key: str, now: float) -> str | None:
        entry = scope.entries.get(key)
        if entry is None:
            return None
        if entry[1] is not None and entry[1] <= now:
            del scope.entries[key]
            scope.size -= _entry_size(key, entry[0])
            return None
        return entry[0]

    def _drop_expired(self, scope: _Scope, now: float) -> None:
        for key in list(scope.entries):
            self._live(scope, key, now)

    def _write(self, scope: _Scope, key: str, old: str | None, value: str,
               write: StateWrite, now: float) -> str:
        grows = _entry_size(key, value) - (_entry_size(key, old) if old is not None else 0)
        if write.max_scope_bytes and grows > 0 and scope.size + grows > write.max_scope_bytes:
            self._drop_expired(scope, now)
            if scope.size + grows > write.max_scope_bytes:
                return STATE_OVER_QUOTA
        scope.entries[key] = (value, now + write.ttl_ms / 1000 if write.ttl_ms else None)
        scope.size += grows
        if write.scope_ttl_ms and scope.expires is None:
            scope.expires = now + write.scope_ttl_ms / 1000
        return STATE_WRITTEN

    async def get(self, scope: str, key: str) -> str | None:
        now = time.monotonic()
        held = self._scope(scope, now, create=False)
        return None if held is None else self._live(held, key, now)

    async def put(self, scope: str, key: str, value: str, write: StateWrite, *,
                  conditional: bool = False, expected: str | None = None) -> str:
        now = time.monotonic()
        self._sweep(now)
        held = self._scope(scope, now, create=True)
        assert held is not None
        old = self._live(held, key, now)
        if conditional and old != expected:
            return STATE_MISMATCH
        return self._write(held, key, old, value, write, now)

    async def increment(self, scope: str, key: str, by: int, write: StateWrite) -> int | str:
        now = time.monotonic()
        self._sweep(now)
        held = self._scope(scope, now, create=True)
        assert held is not None
        old = self._live(held, key, now)
        if old is not None and not _is_integer(old):
            return STATE_NOT_INTEGER
        value = (int(old) if old is not None else 0) + by
        if abs(value) > _MAX_INTEGER:  # as in Redis, whose Lua counts exactly to 2**53
            return STATE_NOT_INTEGER
        outcome = self._write(held, key, old, str(value), write, now)
        return value if outcome == STATE_WRITTEN else outcome

    async def delete(self, scope: str, key: str) -> bool:
        now = time.monotonic()
        held = self._scope(scope, now, create=False)
        if held is None or self._live(held, key, now) is None:
            return False
        value, _ = held.entries.pop(key)
        held.size -= _entry_size(key, value)
        if not held.entries and held.expires is None:
            del self._scopes[scope]  # a principal's emptied scope costs nothing
        return True

    async def keys(self, scope: str, prefix: str) -> list[str]:
        now = time.monotonic()
        held = self._scope(scope, now, create=False)
        if held is None:
            return []
        return sorted(key for key in list(held.entries)
                      if key.startswith(prefix) and self._live(held, key, now) is not None)

    async def end_scope(self, scope: str, retention_ms: int) -> None:
        now = time.monotonic()
        held = self._scope(scope, now, create=False)
        if held is None:
            return
        held.expires = now + retention_ms / 1000
        self._ending[scope] = held.expires


def _is_integer(text: str) -> bool:
    body = text[1:] if text.startswith("-") else text
    return body.isascii() and body.isdigit()
