"""The batched writer: group commit, retries without loss, flush on close, queue depth."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from stargrpc import metrics
from stargrpc.audit.chain import verify
from stargrpc.audit.record import AuditRecord
from stargrpc.audit.store import AuditStore, open_store
from stargrpc.audit.writer import AuditCommitPending, AuditWriter
from tests.audit.records import make_record

WAIT = 30.0  # a bound on waits, never a claim about speed


class CountingStore:
    """A real store that counts transactions and can refuse the first few."""

    def __init__(self, store: AuditStore, failures: int = 0) -> None:
        self.inner = store
        self.url = store.url
        self.transactions = 0
        self.failures = failures

    async def open(self) -> None:
        await self.inner.open()

    async def append(self, records: Sequence[AuditRecord]) -> list[AuditRecord]:
        if self.failures:
            self.failures -= 1
            raise ConnectionError("store unreachable")
        self.transactions += 1
        return await self.inner.append(records)

    async def query(self, query):  # type: ignore[no-untyped-def]
        return await self.inner.query(query)

    def scan(self, batch: int = 1000):  # type: ignore[no-untyped-def]
        return self.inner.scan(batch)

    async def aclose(self) -> None:
        await self.inner.aclose()


def _depth() -> float:
    return metrics.REGISTRY.get_sample_value("tool_executor_audit_queue_depth") or 0.0


async def test_records_submitted_together_share_one_transaction(sqlite_url: str) -> None:
    store = CountingStore(open_store(sqlite_url))
    writer = AuditWriter(store, max_batch=500)
    await writer.start()
    before = _depth()

    futures = [writer.submit(make_record()) for _ in range(100)]
    assert _depth() == before + 100
    stored = [await future for future in futures]
    await writer.flush()

    assert store.transactions == 1
    assert [r.seq for r in stored] == list(range(1, 101))
    assert _depth() == before
    await writer.aclose()


async def test_batches_are_bounded(sqlite_url: str) -> None:
    store = CountingStore(open_store(sqlite_url))
    writer = AuditWriter(store, max_batch=10)
    await writer.start()
    for _ in range(35):
        writer.submit(make_record())
    await writer.flush()
    await writer.aclose()

    assert store.transactions == 4


async def test_a_failing_store_loses_nothing(sqlite_url: str) -> None:
    store = CountingStore(open_store(sqlite_url), failures=3)
    writer = AuditWriter(store)
    await writer.start()

    records = [make_record() for _ in range(5)]
    futures = [writer.submit(record) for record in records]
    stored = [await future for future in futures]
    await writer.aclose()

    assert [r.id for r in stored] == [r.id for r in records]
    reopened = open_store(sqlite_url)
    await reopened.open()
    assert [r.id async for r in reopened.scan()] == [r.id for r in records]
    assert (await verify(reopened.scan())).intact
    await reopened.aclose()


async def test_close_writes_everything_queued(store_url: str) -> None:
    writer = AuditWriter(open_store(store_url))
    await writer.start()
    for _ in range(50):
        writer.submit(make_record())
    assert writer.pending == 50

    await writer.aclose()

    reopened = open_store(store_url)
    await reopened.open()
    count = len([r async for r in reopened.scan()])
    await reopened.aclose()
    assert count == 50
    assert writer.pending == 0


class GatedStore(CountingStore):
    """A real store whose appends wait until the test opens the gate."""

    def __init__(self, store: AuditStore) -> None:
        super().__init__(store)
        self.gate = asyncio.Event()

    async def append(self, records: Sequence[AuditRecord]) -> list[AuditRecord]:
        await self.gate.wait()
        return await super().append(records)


async def test_a_caller_stops_waiting_for_a_slow_store_and_the_record_still_lands(
        sqlite_url: str) -> None:
    store = GatedStore(open_store(sqlite_url))
    writer = AuditWriter(store, commit_wait=0.05)
    await writer.start()

    future = writer.submit(make_record())
    with pytest.raises(AuditCommitPending):
        await asyncio.wait_for(future, 5)
    assert writer.pending == 1

    store.gate.set()
    await asyncio.wait_for(writer.flush(), 5)
    await writer.aclose()
    assert store.transactions == 1
    assert writer.pending == 0


async def test_a_record_the_store_declines_to_append_at_once_goes_to_the_task_at_once(
        sqlite_url: str) -> None:
    # Another writer holds the lock: the store declines the append on the loop. The record
    # goes straight to the write task (which waits for the lock), not through another
    # try on the next turn of the loop.
    store = open_store(sqlite_url)
    tries: list[int] = []

    class Declining:
        def __getattr__(self, name: str) -> object:
            return getattr(store, name)

        def append_now(self, records: Sequence[AuditRecord]) -> None:
            tries.append(len(records))
            return None  # as when another process holds the write lock

    writer = AuditWriter(Declining())  # type: ignore[arg-type]
    await writer.start()
    future = writer.submit_alone(make_record())
    assert isinstance(future, asyncio.Future)
    assert writer._task is not None  # already handed to the task
    stored = await future
    await writer.aclose()

    assert stored.seq == 1
    assert tries == [1]



async def test_a_record_committed_at_once_is_not_appended_again_when_bookkeeping_fails(
        sqlite_url: str) -> None:
    # The commit went through; what follows it (scheduling a checkpoint) fails. The record
    # is stored, once: a failure after the commit must not read as a declined append.
    store = open_store(sqlite_url)
    writer = AuditWriter(store)
    await writer.start()

    def failing() -> None:
        raise RuntimeError("cannot schedule new futures after shutdown")

    store._fast_committed = failing  # type: ignore[attr-defined]
    stored = writer.submit_alone(make_record())
    if isinstance(stored, asyncio.Future):
        stored = await stored
    await writer.flush()
    records = [r async for r in store.scan()]
    await writer.aclose()

    assert [r.id for r in records] == [stored.id]


class CountingFastStore(CountingStore):
    """A CountingStore with the SQLite store's fast path (the writer's first choice), each
    transaction through it counted too."""

    def append_now(self, records: Sequence[AuditRecord]) -> list[AuditRecord] | None:
        stored = self.inner.append_now(records)  # type: ignore[attr-defined]
        if stored is not None:
            self.transactions += 1
        return stored


@pytest.mark.parametrize("alone", ["queued", "alone"])
async def test_a_record_waits_for_the_records_coming_next_to_share_its_transaction(
        sqlite_url: str, alone: str) -> None:
    store = CountingFastStore(open_store(sqlite_url))
    writer = AuditWriter(store, group_wait=WAIT)  # only "nothing more is coming" ends it
    await writer.start()

    first = writer.submit(make_record(), more_coming=True)
    for _ in range(3):  # the other calls end some turns of the loop later
        await asyncio.sleep(0)
    assert not first.done() and store.transactions == 0
    second = writer.submit(make_record(), more_coming=True)
    # Nothing more is coming (the server is no longer busy, or no other call is open): the
    # waiting write goes on the next turn, with this record in it.
    last = (writer.submit(make_record()) if alone == "queued"
            else writer.submit_alone(make_record()))
    assert isinstance(last, asyncio.Future)
    stored = await asyncio.wait_for(asyncio.gather(first, second, last), WAIT)

    assert store.transactions == 1
    assert [record.seq for record in stored] == [1, 2, 3]
    await writer.aclose()


async def test_the_wait_for_the_records_coming_next_is_bounded(sqlite_url: str) -> None:
    store = CountingFastStore(open_store(sqlite_url))
    writer = AuditWriter(store, group_wait=0.05)
    await writer.start()

    stored = await asyncio.wait_for(writer.submit(make_record(), more_coming=True), WAIT)

    assert stored.seq == 1 and store.transactions == 1
    await writer.aclose()


async def test_without_a_group_wait_each_turn_commits_its_own(sqlite_url: str) -> None:
    store = CountingFastStore(open_store(sqlite_url))
    writer = AuditWriter(store)  # group_wait 0: the next turn of the loop, as always
    await writer.start()

    first = writer.submit(make_record(), more_coming=True)
    for _ in range(3):
        await asyncio.sleep(0)
    assert first.done() and store.transactions == 1
    await asyncio.wait_for(writer.submit(make_record(), more_coming=True), WAIT)

    assert store.transactions == 2
    await writer.aclose()


async def test_a_full_batch_does_not_wait(sqlite_url: str) -> None:
    store = CountingStore(open_store(sqlite_url))  # the task's path this time
    writer = AuditWriter(store, max_batch=3, group_wait=WAIT)
    await writer.start()

    futures = [writer.submit(make_record(), more_coming=True) for _ in range(3)]
    await asyncio.wait_for(asyncio.gather(*futures), WAIT)

    assert store.transactions == 1
    await writer.aclose()


async def test_close_writes_a_waiting_record_at_once(sqlite_url: str) -> None:
    writer = AuditWriter(open_store(sqlite_url), group_wait=WAIT)
    await writer.start()
    record = make_record()
    future = writer.submit(record, more_coming=True)
    await asyncio.sleep(0)
    assert not future.done()  # waiting for the records coming next

    await asyncio.wait_for(writer.aclose(), WAIT)

    assert future.done() and future.result().id == record.id
    reopened = open_store(sqlite_url)
    await reopened.open()
    assert [r.id async for r in reopened.scan()] == [record.id]
    await reopened.aclose()
