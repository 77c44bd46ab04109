"""A run's log as the Redis store keeps it: written on the replica running it
(:class:`RedisRunLog`), read from Redis on any other (:class:`RemoteRunLog`), and the runs
of this replica (:class:`LocalRuns`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Sequence
from typing import Any, Protocol

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from stargrpc.errors import Aborted, Unavailable
from stargrpc.stores.memory import MemoryRunLog
from stargrpc.stores.redis.errors import reachable
from stargrpc.v1 import events_pb2

#: A flush sends at most this many bytes of events in one script call.
FLUSH_BATCH_BYTES = 4 * 1024 * 1024
#: Entries a watcher reads per XREAD (file chunks are up to a few hundred KiB each).
_READ_COUNT = 64
#: How long a watcher waits before reading again after Redis did not answer.
_OUTAGE_RETRY_SECONDS = 0.2


class RedisRunLog(MemoryRunLog):
    """The log of a run executing on this replica: in memory for local readers, flushed to
    the Redis stream in order for everyone else (by the store's flusher).

    Attributes:
        claim_key: The key of the run's idempotency claim ("" without one).
        claim_value: What its claim holds.
        registered: Whether the run's lease and meta hash are in Redis (by its claim or
            first flush).
        lease_lost: Whether another replica declared the run lost: nothing more is written.
        swept: Whether the run was put into ``runs:running`` (the sweep looks at it).
        deadline: When (monotonic) the call starting the run stops waiting for Redis.
    """

    claim_key: str
    claim_value: str
    registered: bool
    lease_lost: bool
    swept: bool
    deadline: float
    _wants_flush: Callable[[RedisRunLog], None]
    _pending: list[tuple[int, bytes, bool]]
    _flushing: bool

    def __init__(self, run_id: str, owner: str, tool: str,
                 wants_flush: Callable[[RedisRunLog], None]) -> None:
        """
        Args:
            run_id: The run's id.
            owner: The principal that started it.
            tool: The tool it runs.
            wants_flush: Told when the log has events to write (its first pending one, and
                its Result).
        """
        super().__init__(run_id, owner=owner, tool=tool)
        self._wants_flush = wants_flush
        self.claim_key = ""
        self.claim_value = ""
        self.registered = False
        self.lease_lost = False
        self.swept = False
        self.deadline = 0.0  # set on publish
        self._pending = []
        self._flushing = False

    def append_nowait(self, event: events_pb2.RunEvent) -> events_pb2.RunEvent:
        event = super().append_nowait(event)
        if self._flushing and not self.lease_lost:
            clean = not self._pending
            # The same bytes the run's own streams send (serialised once, kept by the log).
            self._pending.append((event.seq, self.encoded(event.seq), self.finished))
            # A log with events pending is already due a flush (or being flushed, and then
            # handed back for the rest): only its first event, and its Result, which is
            # written at once, need telling the flusher.
            if clean or self.finished:
                self._wants_flush(self)
        return event

    def start_flushing(self) -> None:
        """Copies events to Redis from now on (once the run is published)."""
        self._flushing = True

    @property
    def has_pending(self) -> bool:
        """Whether events of the run are still to be written to Redis."""
        return bool(self._pending)

    def resend_from(self, seq: int) -> None:
        """Queues the events from ``seq`` up to the pending ones again (the store lost them
        in a failover), ahead of what is pending."""
        first = self._pending[0][0] if self._pending else self.last_seq + 1
        self._pending[:0] = [(n, self.encoded(n), False) for n in range(max(1, seq), first)]

    def next_batch(self) -> list[tuple[int, bytes, bool]]:
        """The oldest pending events, up to :data:`FLUSH_BATCH_BYTES` (at least one): each
        (seq, bytes, whether it is the Result)."""
        batch: list[tuple[int, bytes, bool]] = []
        size = 0
        for item in self._pending:
            if batch and size + len(item[1]) > FLUSH_BATCH_BYTES:
                break
            batch.append(item)
            size += len(item[1])
        return batch

    def written(self, count: int) -> None:
        """Drops the oldest ``count`` pending events: they are in Redis."""
        del self._pending[:count]

    def stop_writing(self) -> None:
        """Writes nothing more of the run (it was declared lost, or Redis holds a conflicting
        event): what is pending is dropped."""
        self.lease_lost = True
        self._pending.clear()


class LocalRuns:
    """The runs executing on this replica, by id, until their Result is in Redis: their
    readers read them from memory, and their leases are renewed."""

    _logs: dict[str, RedisRunLog]

    def __init__(self) -> None:
        self._logs = {}

    def add(self, log: RedisRunLog) -> None:
        """Counts ``log`` as running here."""
        self._logs[log.run_id] = log

    def get(self, run_id: str) -> RedisRunLog | None:
        """The log of a run of this replica."""
        return self._logs.get(run_id)

    def forget(self, run_id: str) -> None:
        """The run is finished and fully in Redis (or discarded): readers read it there."""
        self._logs.pop(run_id, None)

    def clear(self) -> None:
        """Forgets every run."""
        self._logs.clear()

    def __contains__(self, run_id: object) -> bool:
        return run_id in self._logs

    def __iter__(self) -> Iterator[RedisRunLog]:
        return iter(list(self._logs.values()))


class RunLookup(Protocol):
    """What a :class:`RemoteRunLog` asks of the store: where its events are, and whether
    its run is still going."""

    @property
    def redis(self) -> Redis | RedisCluster: ...

    @property
    def block_ms(self) -> int: ...

    @property
    def lease_ms(self) -> int: ...

    def events_key(self, run_id: str) -> str: ...

    async def end_if_lost(self, run_id: str) -> None: ...

    async def state(self, run_id: str) -> str: ...


class RemoteRunLog:
    """A run's log as any replica reads it from Redis."""

    run_id: str
    owner: str
    tool: str
    _lookup: RunLookup
    _finished: bool
    _last_seq: int
    _raw: dict[int, bytes]
    # Where the run sits in its call tree (from its summary), for a run below a root.
    parent_run_id = ""
    root_run_id = ""
    depth = 0
    lane = ""
    priority = 0

    def __init__(self, lookup: RunLookup, run_id: str, owner: str, tool: str,
                 finished: bool, last_seq: int) -> None:
        self._lookup = lookup
        self.run_id = run_id
        self.owner = owner
        self.tool = tool
        self._finished = finished
        self._last_seq = last_seq
        self._raw = {}

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def last_seq(self) -> int:
        return self._last_seq

    async def append(self, event: events_pb2.RunEvent) -> events_pb2.RunEvent:
        raise RuntimeError(f"run {self.run_id} is written by the replica running it")

    def append_nowait(self, event: events_pb2.RunEvent) -> events_pb2.RunEvent:
        raise RuntimeError(f"run {self.run_id} is written by the replica running it")

    async def follow(self, after_seq: int = 0, *, max_lag: int = 0
                     ) -> AsyncIterator[events_pb2.RunEvent]:
        batches = self.follow_batches(after_seq, max_lag=max_lag)
        async with contextlib.aclosing(batches):
            async for batch in batches:
                for event in batch:
                    yield event

    def encoded(self, seq: int) -> bytes:
        """The bytes of event ``seq`` as Redis gave them, for the events of the latest
        batch (one follower per opened log: the store's ``open`` makes one each).

        Raises:
            IndexError: That event is not in the latest batch (as :class:`RunLog` says).
        """
        try:
            return self._raw[seq]
        except KeyError:
            raise IndexError(f"no bytes of event {seq} of run {self.run_id}") from None

    async def follow_batches(self, after_seq: int = 0, *, max_lag: int = 0
                             ) -> AsyncGenerator[Sequence[events_pb2.RunEvent], None]:
        """As :meth:`follow`; a batch is what one read from Redis returned."""
        # Reading from Redis holds nothing per watcher, so ``max_lag`` is not needed here;
        # the stream's own trimming is what a slow watcher can fall behind.
        del max_lag
        lookup = self._lookup
        key = lookup.events_key(self.run_id)
        expected = max(0, after_seq) + 1
        last_id = f"{expected - 1}-0"
        # A stalled Redis is ridden out for as long as the run could still be going (its
        # lease, then as long again before it may be declared lost); a longer outage ends the
        # watch UNAVAILABLE, and the caller resumes after the last seq it saw.
        outage_since: float | None = None
        while True:
            try:
                with reachable("reading run events"):
                    # The client's reply types are loose; the shape is [[key, [(id, fields)]]].
                    reply: Any = await lookup.redis.xread({key: last_id}, count=_READ_COUNT,
                                                          block=lookup.block_ms)
                    if not reply and await self._ended(last_id):
                        return
            except Unavailable as exc:
                now = time.monotonic()
                outage_since = now if outage_since is None else outage_since
                if (exc.reason != "RUN_STORE_UNAVAILABLE"
                        or now - outage_since > 2 * lookup.lease_ms / 1000):
                    raise
                await asyncio.sleep(_OUTAGE_RETRY_SECONDS)
                continue
            outage_since = None
            if not reply:
                continue
            batch: list[events_pb2.RunEvent] = []
            self._raw = {}
            for entry_id, fields in reply[0][1]:
                seq = int(entry_id.split(b"-", 1)[0])
                if seq != expected:
                    if batch:
                        break  # send what came before the gap first
                    raise Aborted(
                        f"events {expected}..{seq - 1} of run {self.run_id} were trimmed "
                        f"(run_max_events); resume with after_seq={seq - 1} to skip them",
                        reason="EVENTS_TRIMMED",
                        metadata={"run_id": self.run_id, "first_kept_seq": str(seq)})
                data = fields[b"e"]
                event = events_pb2.RunEvent.FromString(data)
                self._raw[event.seq] = data  # as the stream asks for it (by the event's seq)
                batch.append(event)
                expected += 1
                last_id = entry_id.decode()
                if event.HasField("result"):
                    break
            if batch:
                yield batch
                if batch[-1].HasField("result"):
                    return

    async def _ended(self, last_id: str) -> bool:
        # Quiet for a while: make sure the run is still alive somewhere, and stop when it
        # has ended and nothing is left after ``last_id`` (a watcher that asked for events
        # past the Result).
        lookup = self._lookup
        await lookup.end_if_lost(self.run_id)
        return (await lookup.state(self.run_id) not in ("running", "orphaned")
                and not await lookup.redis.xrange(lookup.events_key(self.run_id),
                                                  f"({last_id}", count=1))
