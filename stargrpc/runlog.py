"""Per-run event logs: every event of a run, in order, with a gapless ``seq``.

The Execute stream, WatchRun streams and idempotent replays all read a run through its log,
so a run can outlive the stream that started it. :class:`MemoryRunStore` is the embedded
default; a shared store (Redis) implements the same two protocols for a fleet.

Events are kept as ``RunEvent`` protobuf messages rather than a parallel Python model: they
are built once, stored once and sent as they are, which keeps the per-event cost low.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from stargrpc.v1 import events_pb2


class RunLog(Protocol):
    """The event log of one run."""

    run_id: str

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

    def follow(self, after_seq: int = 0) -> AsyncIterator[events_pb2.RunEvent]:
        """Yields the events after ``after_seq``, then new ones as they come, until the Result."""
        ...


class RunStore(Protocol):
    """Where run logs live."""

    def create(self, run_id: str) -> RunLog:
        """A new, empty log for ``run_id``."""
        ...

    def get(self, run_id: str) -> RunLog | None:
        """The log of ``run_id``, or None when unknown or expired."""
        ...


class MemoryRunLog:
    """A run log held in this process."""

    run_id: str
    _events: list[events_pb2.RunEvent]
    _wakeup: asyncio.Event
    _finished: bool
    finished_at: float | None

    def __init__(self, run_id: str,
                 on_finish: Callable[[MemoryRunLog], None] | None = None) -> None:
        self.run_id = run_id
        self._on_finish = on_finish
        self._events = []
        self._wakeup = asyncio.Event()
        self._finished = False
        self.finished_at = None

    @property
    def finished(self) -> bool:
        return self._finished

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
            event.time.GetCurrentTime()
        self._events.append(event)
        if event.WhichOneof("kind") == "result":
            self._finished = True
            self.finished_at = time.monotonic()
            if self._on_finish is not None:
                self._on_finish(self)
        # Wake every follower waiting on the current event, then give later waiters a
        # fresh one: a follower never misses a wake-up between checking and waiting.
        wakeup, self._wakeup = self._wakeup, asyncio.Event()
        wakeup.set()
        return event

    async def follow(self, after_seq: int = 0) -> AsyncIterator[events_pb2.RunEvent]:
        position = max(0, after_seq)
        while True:
            if position < len(self._events):
                batch = self._events[position:]
                position += len(batch)
                for event in batch:
                    yield event
                continue
            if self._finished:
                return
            await self._wakeup.wait()


class MemoryRunStore:
    """Run logs in memory. A finished run is dropped ``retention`` seconds after its Result,
    or earlier (oldest first) while more than ``max_finished`` finished runs are kept."""

    retention: float
    max_finished: int
    _logs: dict[str, MemoryRunLog]
    _finished: deque[tuple[float, str]]

    def __init__(self, retention: float = 600.0, max_finished: int = 10_000) -> None:
        self.retention = retention
        self.max_finished = max_finished
        self._logs = {}
        self._finished = deque()

    def create(self, run_id: str) -> MemoryRunLog:
        self._expire()
        log = MemoryRunLog(run_id, on_finish=self._record_finish)
        self._logs[run_id] = log
        return log

    def get(self, run_id: str) -> MemoryRunLog | None:
        self._expire()
        return self._logs.get(run_id)

    def __len__(self) -> int:
        return len(self._logs)

    def _record_finish(self, log: MemoryRunLog) -> None:
        self._finished.append((log.finished_at or time.monotonic(), log.run_id))

    def _expire(self) -> None:
        deadline = time.monotonic() - self.retention
        while self._finished and (
            self._finished[0][0] < deadline or len(self._finished) > self.max_finished
        ):
            _, run_id = self._finished.popleft()
            self._logs.pop(run_id, None)
