"""The batched audit writer: calls hand records over and go on; whatever has queued up by
the time the event loop comes round is written in one transaction (group commit).

When more records are likely to follow soon (a busy server: :meth:`AuditWriter.submit`
with ``more_coming``), a record waits up to ``group_wait`` for them to join its
transaction: under many concurrent calls their records reach the writer about a loop turn
apart, and one transaction each would cost a commit per call (measured in
``bench/README.md``). A record submitted with nothing more to come, or a full batch, is
written on the next turn as before.

A store that can append at once without waiting (SQLite's fast path,
:meth:`~stargrpc.audit.sqlite.SqliteAuditStore.append_now`) is written to from a plain
callback: no task and no thread hop per batch. Otherwise, or when that fast path declines, a
task writes the batch with the store's ``append``.

Nothing is dropped: a failed write is retried (with backoff) until it succeeds or the
writer is closed, and :meth:`AuditWriter.aclose` writes everything still queued. A batch the
store *refuses* for its records' content (the store's ``refuses(exc)`` says so: a
constraint, a value it cannot hold — trying again would fail again) is not retried as it
is, or the trail would stop behind it: it is split in halves, written in order, until the
records refused alone are found. Each of those is replaced in the trail by a substitute that
says it was refused and why (:func:`~stargrpc.audit.record.refused_substitute`), chained
like any record, while the record itself goes whole into the error log line
``audit_record_refused`` and the counter ``stargrpc_audit_records_refused_total`` counts
it. Should the store refuse the substitute too, the trouble is the store's, not the
record's: the record is retried with backoff like any failed write. A caller
that must know its record is durable awaits the future :meth:`AuditWriter.submit` returns
(:meth:`AuditWriter.submit_alone` returns the stored record itself when it committed it at
once); when the store keeps it waiting longer than ``commit_wait``, the future fails with
:class:`AuditCommitPending` while the record is still being written.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Sequence

import structlog

from stargrpc import metrics
from stargrpc.audit.record import AuditRecord, refused_substitute, storable
from stargrpc.audit.store import AuditStore

log = structlog.get_logger("stargrpc.audit")

_Entry = tuple[AuditRecord, "asyncio.Future[AuditRecord]"]
_AppendNow = Callable[[Sequence[AuditRecord]], "list[AuditRecord] | None"]


class AuditCommitPending(Exception):
    """The record is not committed yet after ``commit_wait`` seconds; the writer goes on
    trying, so it is not lost, only late."""


class AuditWriter:
    """Writes audit records to a store in batches, off the calls' path.

    Attributes:
        store: Where the records go.
        max_batch: Most records per transaction.
        close_timeout: How long :meth:`aclose` keeps trying to write what is queued.
        commit_wait: How long a submitted record's future may stay pending (0: no bound).
        group_wait: Longest a record submitted with ``more_coming`` waits for others to
            share its transaction (0: none; the next turn of the loop).
    """

    store: AuditStore
    max_batch: int
    close_timeout: float
    commit_wait: float
    group_wait: float
    _queue: deque[_Entry]
    _pending: int
    _idle: asyncio.Event
    _append_now: _AppendNow | None
    _scheduled: bool
    _group_timer: asyncio.TimerHandle | None
    _task: asyncio.Task[None] | None
    _release_timer: asyncio.TimerHandle | None
    _started: bool
    _closed: bool
    _interrupted: set[str]

    def __init__(self, store: AuditStore, *, max_batch: int = 500,
                 close_timeout: float = 30.0, commit_wait: float = 0.0,
                 group_wait: float = 0.0) -> None:
        self.store = store
        self.max_batch = max_batch
        self.close_timeout = close_timeout
        self.commit_wait = commit_wait
        self.group_wait = group_wait
        self._queue = deque()
        self._pending = 0
        self._idle = asyncio.Event()
        self._idle.set()
        # A store that appends at once when it can (SQLite, unless told not to on the loop).
        self._append_now = (getattr(store, "append_now", None)
                            if getattr(store, "on_loop", True) else None)
        self._scheduled = False
        self._group_timer = None
        self._task = None
        self._release_timer = None
        self._started = False
        self._closed = False
        self._interrupted = set()

    async def start(self) -> None:
        """Opens the store; records submitted before are written from now on."""
        await self.store.open()
        self._started = True
        self._schedule()

    @property
    def pending(self) -> int:
        """Records submitted and not yet written."""
        return self._pending

    def submit(self, record: AuditRecord, *, more_coming: bool = False
               ) -> asyncio.Future[AuditRecord]:
        """Queues ``record``; the future resolves to the stored record once committed.

        Args:
            record: The record.
            more_coming: Other records are likely to follow soon (many calls are open):
                the transaction waits up to :attr:`group_wait` for them.

        Raises:
            RuntimeError: The writer is closed.
        """
        if self._closed:
            raise RuntimeError("the audit writer is closed")
        return self._enqueue(storable(record), declined=False, more_coming=more_coming)

    def submit_alone(self, record: AuditRecord
                     ) -> AuditRecord | asyncio.Future[AuditRecord]:
        """Like :meth:`submit`, for a caller that knows no other record is coming to share
        its transaction (no other call in flight): when nothing is queued and the store can
        append without waiting, the record is committed right here and returned as stored
        — no future to make and await, and no turn of the event loop. Otherwise the
        future :meth:`submit` gives.

        Raises:
            RuntimeError: The writer is closed.
        """
        if self._closed:
            raise RuntimeError("the audit writer is closed")
        record = storable(record)
        if self._queue or self._scheduled or self._task is not None or not self._started \
                or self._append_now is None:
            return self._enqueue(record, declined=False)
        # Committed right here, never queued (the queue's bookkeeping and gauge skipped).
        stored = self._append_at_once([record])
        if stored is not None:
            return stored[0]
        return self._enqueue(record, declined=True)

    def _enqueue(self, record: AuditRecord, *, declined: bool, more_coming: bool = False
                 ) -> asyncio.Future[AuditRecord]:
        future: asyncio.Future[AuditRecord] = asyncio.get_running_loop().create_future()
        self._queue.append((record, future))
        self._pending += 1
        self._idle.clear()
        metrics.AUDIT_QUEUE_DEPTH.inc()
        if declined:
            # The store just declined to append at once (another writer holds the lock):
            # straight to the task that waits for it, not another try on the next turn.
            self._write_in_task(self._take_batch())
        else:
            self._schedule(more_coming=more_coming)
        return future

    async def flush(self) -> None:
        """Waits until everything submitted so far is written."""
        await self._idle.wait()

    async def aclose(self) -> None:
        """Writes what is queued (for up to ``close_timeout`` seconds), then closes."""
        self._closed = True
        if self._started:
            self._schedule()  # what waits for others to join its transaction: now
            try:
                await asyncio.wait_for(self.flush(), self.close_timeout)
            except TimeoutError:
                log.error("audit_records_lost", records=self._pending,
                          reason="the audit store did not accept them before shutdown")
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._fail_queued()
        if self._started:
            await self.store.aclose()
            self._started = False

    # -- writing ---------------------------------------------------------------------------

    def _schedule(self, *, more_coming: bool = False) -> None:
        # One write at a time: every record submitted until it runs joins the same
        # transaction. It runs on the next turn of the loop, or up to group_wait later when
        # more records are coming and the batch has room.
        if not self._started or self._task is not None or not self._queue:
            return
        wait = more_coming and self.group_wait > 0 and len(self._queue) < self.max_batch
        if self._scheduled:
            if not wait and self._group_timer is not None:
                # Nothing more is coming (or the batch is full): the waiting write goes now.
                self._group_timer.cancel()
                self._group_timer = None
                asyncio.get_running_loop().call_soon(self._write_queued)
            return
        self._scheduled = True
        loop = asyncio.get_running_loop()
        if wait:
            self._group_timer = loop.call_later(self.group_wait, self._write_queued)
        else:
            loop.call_soon(self._write_queued)

    def _take_batch(self) -> list[_Entry]:
        count = min(self.max_batch, len(self._queue))
        return [self._queue.popleft() for _ in range(count)]

    def _write_queued(self) -> None:
        self._scheduled = False
        self._group_timer = None
        if self._task is not None or not self._queue:
            return
        batch = self._take_batch()
        if self._append_now is not None:
            stored = self._append_at_once([record for record, _ in batch])
            if stored is not None:
                self._settle(batch, stored)
                self._schedule()
                return
        self._write_in_task(batch)

    def _write_in_task(self, batch: list[_Entry]) -> None:
        self._task = asyncio.create_task(self._write_batch(batch), name="audit-writer")

    def _append_at_once(self, records: list[AuditRecord]) -> list[AuditRecord] | None:
        """The store's fast path; None when it declines or fails (then the task writes)."""
        assert self._append_now is not None
        try:
            return self._append_now(records)
        except Exception as exc:  # the task's retries report it if it persists
            log.warning("audit_fast_write_failed", error=str(exc) or type(exc).__name__)
            return None

    async def _write_batch(self, batch: list[_Entry]) -> None:
        # The store makes this batch wait: bound how long its callers wait with it — and the
        # callers of the records queued behind it, which wait for this write to end first.
        release = (asyncio.get_running_loop().call_later(
            self.commit_wait, self._release_waiting, batch) if self.commit_wait > 0 else None)
        try:
            self._settle(batch, await self._write(batch))
        except asyncio.CancelledError:
            # Closing: this batch's write was cut off — the store may still commit it (a
            # thread's statement runs on, a commit may have reached the server).
            self._interrupted.update(record.id for record, _ in batch)
            self._queue.extendleft(reversed(batch))
            raise
        finally:
            self._task = None
            if release is not None:
                release.cancel()
            if self._release_timer is not None:
                self._release_timer.cancel()
                self._release_timer = None
        self._schedule()

    def _release_waiting(self, batch: list[_Entry]) -> None:
        """The store has kept a write waiting ``commit_wait``: every caller still waiting —
        the batch's and those queued behind it — goes on without its commit (the records
        stay queued, to be written when the store answers). Callers that queue meanwhile
        are let go ``commit_wait`` later, for as long as this write lasts."""
        _release(batch)
        _release(list(self._queue))
        self._release_timer = asyncio.get_running_loop().call_later(
            self.commit_wait, self._release_waiting, batch)

    async def _write(self, batch: list[_Entry]) -> list[AuditRecord]:
        return await self._append([record for record, _ in batch])

    async def _append(self, records: list[AuditRecord]) -> list[AuditRecord]:
        """``records`` as stored, in order: retried while the store fails; split when it
        refuses them; a record refused alone replaced by its substitute."""
        delay = 0.05
        while True:
            try:
                return await self.store.append(records)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self._refuses(exc):
                    if len(records) > 1:  # which of them? Each half in turn, in order
                        log.warning("audit_batch_refused", records=len(records),
                                    error=_said(exc),
                                    action="writing it in halves to find the records refused")
                        half = len(records) // 2
                        return [*await self._append(records[:half]),
                                *await self._append(records[half:])]
                    stored = await self._substitute(records[0], exc)
                    if stored is not None:
                        return [stored]
                # Keep the batch and try again: the trail must not lose records.
                log.error("audit_write_failed", error=str(exc) or type(exc).__name__,
                          records=len(records), retry_in_seconds=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    def _refuses(self, exc: Exception) -> bool:
        refuses = getattr(self.store, "refuses", None)
        return bool(refuses(exc)) if refuses is not None else False

    async def _substitute(self, record: AuditRecord, exc: Exception) -> AuditRecord | None:
        """Stores the substitute of ``record``, which the store refused alone (``exc``),
        and logs ``record`` whole; the substitute as stored, or None when the store refused
        it too (then the store is at fault, not the record)."""
        substitute = refused_substitute(record, _said(exc))
        try:
            [stored] = await self.store.append([substitute])
        except asyncio.CancelledError:
            raise
        except Exception as again:
            log.error("audit_substitute_refused", record_id=record.id, error=_said(exc),
                      substitute_error=_said(again),
                      action="retrying the record: the store refuses even its substitute")
            return None
        metrics.AUDIT_RECORDS_REFUSED.inc()
        # The log is the only place the record itself is kept: whole, for the operator.
        log.error("audit_record_refused", record=record.as_dict(), error=_said(exc),
                  substitute_seq=stored.seq, substitute_id=stored.id,
                  action="stored a substitute in its place; the trail goes on")
        return stored

    def _settle(self, batch: list[_Entry], stored: list[AuditRecord]) -> None:
        for (_, future), record in zip(batch, stored, strict=True):
            if not future.done():
                future.set_result(record)
        self._done(len(batch))

    def _done(self, count: int) -> None:
        self._pending -= count
        metrics.AUDIT_QUEUE_DEPTH.dec(count)
        if self._pending == 0:
            self._idle.set()

    def _fail_queued(self) -> None:
        while self._queue:
            record, future = self._queue.popleft()
            # The log is the last place this record is kept: in full, as the operator may
            # need to put it in the trail by hand (unless its cut-off write went through).
            reason = ("its write was cut off as the writer closed: the trail may hold it; "
                      "look for its id before adding it" if record.id in self._interrupted
                      else "the writer closed before the store accepted it")
            log.error("audit_record_not_stored", record=record.as_dict(), reason=reason)
            if not future.done():
                future.set_exception(RuntimeError("the audit writer closed first"))
                future.exception()  # mark retrieved: nobody may be waiting
        if self._pending:  # queued, or in the batch the close interrupted
            self._done(self._pending)


def _said(exc: BaseException) -> str:
    """What a log line (and a substitute) says of a store's error: its type and message."""
    text = str(exc).split("\n", 1)[0]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _release(batch: list[_Entry]) -> None:
    """Lets the callers of a batch still being written stop waiting for it."""
    for _, future in batch:
        if not future.done():
            future.set_exception(AuditCommitPending())
            future.exception()  # mark retrieved: the caller may have gone
