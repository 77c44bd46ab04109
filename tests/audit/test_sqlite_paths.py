"""The SQLite store's two write paths: the event loop's connection that never waits, and the
store thread's connection that takes over when another writer holds the lock; and the WAL
kept small by checkpoints on the thread."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from stargrpc.audit import sqlite as sqlite_store
from stargrpc.audit.chain import verify
from stargrpc.audit.record import AuditRecord
from stargrpc.audit.sqlite import SqliteAuditStore
from stargrpc.audit.store import Query, sqlite_path
from stargrpc.audit.writer import AuditWriter
from tests.audit.records import make_record


async def test_an_append_waits_for_a_writer_holding_the_lock_without_blocking_the_loop(
        sqlite_url: str) -> None:
    store = SqliteAuditStore(sqlite_url)
    await store.open()
    try:
        await store.append([make_record()])
        # Another process (here: another connection) holds the write lock.
        other = sqlite3.connect(sqlite_path(sqlite_url), isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        append = asyncio.create_task(store.append([make_record()]))
        # The loop keeps running while the append waits on the store's thread.
        for _ in range(5):
            await asyncio.sleep(0.01)
        assert not append.done()
        other.execute("COMMIT")
        other.close()
        [stored] = await asyncio.wait_for(append, 10)
    finally:
        await store.aclose()

    assert stored.seq == 2
    reopened = SqliteAuditStore(sqlite_url)
    await reopened.open()
    try:
        report = await verify(reopened.scan())
    finally:
        await reopened.aclose()
    assert report.intact and report.checked == 2


async def _store_with_small_wal(sqlite_url: str, monkeypatch: pytest.MonkeyPatch,
                                frames: int) -> SqliteAuditStore:
    """An open store that checkpoints every 50 commits and restarts its WAL past ``frames``
    frames."""
    monkeypatch.setattr(sqlite_store, "CHECKPOINT_EVERY", 50)
    monkeypatch.setattr(sqlite_store, "WAL_FRAMES_LIMIT", frames)
    store = SqliteAuditStore(sqlite_url)
    await store.open()
    return store


async def test_the_wal_is_checkpointed_and_stays_small(sqlite_url: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    store = await _store_with_small_wal(sqlite_url, monkeypatch, 200)
    wal = Path(str(sqlite_path(sqlite_url)) + "-wal")
    try:
        for _ in range(1500):  # one transaction each: pages enough for a WAL of megabytes
            await store.append([make_record(arguments="x" * 2000)])
        await store.query(Query(limit=1))  # on the store's thread: after its checkpoints
        wal_bytes = await asyncio.to_thread(os.path.getsize, wal)
        report = await verify(store.scan())
    finally:
        await store.aclose()

    assert report.intact and report.checked == 1500
    # Without checkpoints the WAL holds every transaction: at least 1500 pages of 4 KiB
    # (a record's row and its index entries: several pages each). With them, it starts over
    # once it passes the limit, and its file is cut back to the limit when it does: it
    # holds at most what was committed since it last started over.
    assert wal_bytes < 1500 * 4096 / 2


def _backfilled_frames(shm: Path) -> int:
    """How many WAL frames the last checkpoint copied into the database: ``nBackfill`` of
    the WAL-index (the -shm file), a u32 in native byte order at offset 96
    (https://sqlite.org/walformat.html)."""
    with shm.open("rb") as index:
        return int.from_bytes(index.read(100)[96:100], sys.byteorder)


def _wal_frames(shm: Path) -> int:
    """How many frames the WAL holds: ``mxFrame`` of the WAL-index header, at offset 16."""
    with shm.open("rb") as index:
        return int.from_bytes(index.read(20)[16:20], sys.byteorder)


async def test_appends_made_while_a_checkpoint_runs_are_checkpointed_after_it(
        sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # On a loaded machine a checkpoint's fsync can outlast a whole burst of appends on the
    # loop. The checkpoint measured the WAL at its start, small; the WAL the burst grew
    # must still be emptied once it stops.
    # A limit above what 50 appends write: the first checkpoint sees no reason to restart.
    store = await _store_with_small_wal(sqlite_url, monkeypatch, 1000)
    path = sqlite_path(sqlite_url)
    wal, shm = Path(f"{path}-wal"), Path(f"{path}-shm")
    checkpointed, release = threading.Event(), threading.Event()

    def stall_after_the_first_checkpoint() -> int:
        # SQLite calls this between the steps of a statement on the store's connection:
        # once the first checkpoint has copied its frames, it stays there until released,
        # as if its fsync took that long.
        if not checkpointed.is_set() and _backfilled_frames(shm) > 0:
            checkpointed.set()
            release.wait(30)
        return 0

    await store._run(store._conn.set_progress_handler, stall_after_the_first_checkpoint, 1)
    try:
        for _ in range(50):
            await store.append([make_record(arguments="x" * 2000)])
        assert await asyncio.to_thread(checkpointed.wait, 30)
        for _ in range(1450):
            await store.append([make_record(arguments="x" * 2000)])
        release.set()
        await store.query(Query(limit=1))  # on the store's thread: after its checkpoints
        # Everything the burst wrote is in the database now, with no commit after it
        # needed to get it there.
        frames, backfilled = _wal_frames(shm), _backfilled_frames(shm)
        # The WAL starts over with the next commit, and its file is cut back to the limit.
        await store.append([make_record()])
        wal_bytes = await asyncio.to_thread(os.path.getsize, wal)
        report = await verify(store.scan())
    finally:
        release.set()
        await store.aclose()

    assert report.intact and report.checked == 1501
    assert frames > 1000 and backfilled == frames
    # The burst wrote several times the limit; what is left is within it.
    assert wal_bytes <= 1000 * 4096


async def test_a_reader_keeping_its_snapshot_holds_appends_back_a_moment_only(
        sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A backup, or a transaction left open in a shell, keeps a snapshot of the trail: the
    # WAL cannot start over under it. Each restart used to wait the whole busy timeout for
    # it (10 s, with the write lock held and every append behind it); it waits a moment and
    # gives up, and the WAL starts over once the reader is gone.
    store = await _store_with_small_wal(sqlite_url, monkeypatch, 200)
    path = sqlite_path(sqlite_url)
    reader = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    slowest = 0.0
    try:
        await store.append([make_record()])
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM audit_records").fetchone()  # holds its snapshot
        for _ in range(400):  # several restarts' worth of WAL
            started = asyncio.get_running_loop().time()
            await store.append([make_record(arguments="x" * 2000)])
            slowest = max(slowest, asyncio.get_running_loop().time() - started)
        grown = _wal_frames(Path(f"{path}-shm"))
        reader.execute("COMMIT")  # the reader lets go
        for _ in range(60):  # a round of checkpoints: the restart goes through now
            await store.append([make_record()])
        await store.query(Query(limit=1))  # on the store's thread: after its checkpoints
        await store.append([make_record()])  # the first commit after it starts the WAL over
        frames = _wal_frames(Path(f"{path}-shm"))
        wal_bytes = await asyncio.to_thread(os.path.getsize, f"{path}-wal")
        report = await verify(store.scan())
    finally:
        reader.close()
        await store.aclose()

    assert report.intact and report.checked == 462
    # A few restart waits of a quarter second at the most, never the 10 s busy timeout.
    assert slowest < sqlite_store.BUSY_TIMEOUT_SECONDS / 2
    # The WAL grew past its limit while the reader stayed, started over once it left, and
    # its file was cut back to the limit.
    assert grown > 200 and frames < 200
    assert wal_bytes <= 200 * 4096


async def test_records_submitted_together_are_committed_together_on_the_loop(
        sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    transactions: list[tuple[str, int]] = []
    real_append = sqlite_store._append

    def counting_append(db: sqlite3.Connection, records: Any, *rest: Any) -> Any:
        transactions.append((threading.current_thread().name, len(records)))
        return real_append(db, records, *rest)

    monkeypatch.setattr(sqlite_store, "_append", counting_append)
    writer = AuditWriter(SqliteAuditStore(sqlite_url))
    await writer.start()
    futures = [writer.submit(make_record()) for _ in range(100)]
    stored = [await future for future in futures]
    await writer.aclose()

    assert [record.seq for record in stored] == list(range(1, 101))
    assert transactions == [(threading.main_thread().name, 100)]


async def test_a_record_alone_is_committed_before_submit_returns(sqlite_url: str) -> None:
    writer = AuditWriter(SqliteAuditStore(sqlite_url))
    await writer.start()
    # Committed right here: the stored record itself, no future (nor queue) in between.
    alone = writer.submit_alone(make_record())
    assert isinstance(alone, AuditRecord) and alone.seq == 1 and alone.hash
    assert writer.pending == 0

    # Others queued: it waits for them, to share their transaction.
    queued = writer.submit(make_record())
    joining = writer.submit_alone(make_record())
    assert isinstance(joining, asyncio.Future)
    assert not queued.done() and not joining.done()
    assert [(await queued).seq, (await joining).seq] == [2, 3]
    await writer.aclose()
    with pytest.raises(RuntimeError):
        writer.submit_alone(make_record())


async def test_the_trail_is_indexed_by_time_only(sqlite_url: str) -> None:
    path = sqlite_path(sqlite_url)
    store = SqliteAuditStore(sqlite_url)
    await store.open()
    await store.aclose()
    with sqlite3.connect(path) as db:  # as older versions left it: three indexes more
        db.execute("CREATE INDEX audit_records_tool ON audit_records (tool)")
        db.execute("CREATE INDEX audit_records_principal ON audit_records (principal)")
        db.execute("CREATE INDEX audit_records_run_id ON audit_records (run_id)")

    store = SqliteAuditStore(sqlite_url)
    await store.open()
    await store.append([make_record(tool="echo")])
    [found] = await store.query(Query(tool="echo"))
    await store.aclose()

    with sqlite3.connect(path) as db:
        indexes = {row[0] for row in db.execute(
            "SELECT name FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL")}
    # No query looks a record up by its run: an index by run id, random, would only dirty a
    # page anywhere in its b-tree on every append.
    assert indexes == {"audit_records_time"}
    assert found.tool == "echo"


def _id_indexes(path: Path) -> list[str]:
    """The indexes on the trail's ``id`` column (a UNIQUE constraint's automatic one)."""
    with sqlite3.connect(path) as db:
        names = [row[1] for row in db.execute("PRAGMA index_list(audit_records)")]
        return [name for name in names
                if [row[2] for row in db.execute(f"PRAGMA index_info({name})")] == ["id"]]


async def test_a_new_trail_keeps_no_index_of_ids(sqlite_url: str) -> None:
    # Nothing looks a record up by its id; a unique index on it was a b-tree more to write
    # on every append (ids are version-7 UUIDs: 74 random bits within each millisecond).
    store = SqliteAuditStore(sqlite_url)
    await store.open()
    await store.append([make_record(), make_record()])
    await store.aclose()
    assert _id_indexes(sqlite_path(sqlite_url)) == []


async def test_an_older_trail_keeps_its_unique_ids_and_still_takes_records(
        sqlite_url: str) -> None:
    # A file an older version made keeps its UNIQUE constraint (dropping it would take a
    # rebuild of the table): it goes on taking records, and refusing a repeated id.
    path = sqlite_path(sqlite_url)
    old_schema = [statement.replace("(id TEXT NOT NULL,", "(id TEXT NOT NULL UNIQUE,")
                  for statement in sqlite_store._SCHEMA]
    assert old_schema != sqlite_store._SCHEMA
    path.parent.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(path) as db:
        for statement in old_schema:
            db.execute(statement)
    assert len(_id_indexes(path)) == 1

    store = SqliteAuditStore(sqlite_url)
    await store.open()
    first = make_record()
    await store.append([first, make_record()])
    with pytest.raises(sqlite3.IntegrityError):
        sqlite_store._append(store._fast, [first])  # type: ignore[arg-type]
    report = await verify(store.scan())
    await store.aclose()

    assert report.intact and report.checked == 2
    assert len(_id_indexes(path)) == 1
