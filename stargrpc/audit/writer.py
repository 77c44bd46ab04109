"""The batched audit writer: calls hand records over and go on; one background task
writes whatever has queued up in one transaction (group commit).

Nothing is dropped: a failed write is retried (with backoff) until it succeeds or the
writer is closed, and :meth:`AuditWriter.aclose` writes everything still queued. A caller
that must know its record is durable awaits the future :meth:`AuditWriter.submit` returns.
"""

from __future__ import annotations

import asyncio
import contextlib

import structlog

from stargrpc import metrics
from stargrpc.audit.record import AuditRecord
from stargrpc.audit.store import AuditStore

log = structlog.get_logger("stargrpc.audit")

_Entry = tuple[AuditRecord, "asyncio.Future[AuditRecord]"]


class AuditWriter:
    """Writes audit records to a store in batches, off the calls' path.

    Attributes:
        store: Where the records go.
        max_batch: Most records per transaction.
        close_timeout: How long :meth:`aclose` keeps trying to write what is queued.
    """

    store: AuditStore
    max_batch: int
    close_timeout: float
    _queue: asyncio.Queue[_Entry]
    _pending: int
    _idle: asyncio.Event
    _task: asyncio.Task[None] | None
    _closed: bool

    def __init__(self, store: AuditStore, *, max_batch: int = 500,
                 close_timeout: float = 30.0) -> None:
        self.store = store
        self.max_batch = max_batch
        self.close_timeout = close_timeout
        self._queue = asyncio.Queue()
        self._pending = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._task = None
        self._closed = False

    async def start(self) -> None:
        """Opens the store and starts the background task."""
        await self.store.open()
        self._task = asyncio.create_task(self._run(), name="audit-writer")

    @property
    def pending(self) -> int:
        """Records submitted and not yet written."""
        return self._pending

    def submit(self, record: AuditRecord) -> asyncio.Future[AuditRecord]:
        """Queues ``record``; the future resolves to the stored record once committed.

        Raises:
            RuntimeError: The writer is closed.
        """
        if self._closed:
            raise RuntimeError("the audit writer is closed")
        future: asyncio.Future[AuditRecord] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((record, future))
        self._pending += 1
        self._idle.clear()
        metrics.AUDIT_QUEUE_DEPTH.inc()
        return future

    async def flush(self) -> None:
        """Waits until everything submitted so far is written."""
        await self._idle.wait()

    async def aclose(self) -> None:
        """Writes what is queued (for up to ``close_timeout`` seconds), then closes."""
        self._closed = True
        if self._task is not None:
            try:
                await asyncio.wait_for(self.flush(), self.close_timeout)
            except TimeoutError:
                log.error("audit_records_lost", records=self._pending,
                          reason="the audit store did not accept them before shutdown")
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._fail_queued()
        await self.store.aclose()

    async def _run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while len(batch) < self.max_batch and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            stored = await self._write(batch)
            for (_, future), record in zip(batch, stored, strict=True):
                if not future.done():
                    future.set_result(record)
            self._done(len(batch))

    async def _write(self, batch: list[_Entry]) -> list[AuditRecord]:
        delay = 0.05
        while True:
            try:
                return await self.store.append([record for record, _ in batch])
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # Keep the batch and try again: the trail must not lose records.
                log.error("audit_write_failed", error=str(exc) or type(exc).__name__,
                          records=len(batch), retry_in_seconds=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    def _done(self, count: int) -> None:
        self._pending -= count
        metrics.AUDIT_QUEUE_DEPTH.dec(count)
        if self._pending == 0:
            self._idle.set()

    def _fail_queued(self) -> None:
        while not self._queue.empty():
            _, future = self._queue.get_nowait()
            if not future.done():
                future.set_exception(RuntimeError("the audit writer closed first"))
                future.exception()  # mark retrieved: nobody may be waiting
        if self._pending:  # queued, or in the batch the close interrupted
            self._done(self._pending)
