"""The SQLite audit store: one file in WAL mode, the embedded default.

WAL lets readers (``stargrpc audit tail``) run while the server writes; ``BEGIN IMMEDIATE``
makes each append exclusive among writers, so two processes sharing the file still build
one chain. ``synchronous=NORMAL`` in WAL mode keeps every committed record across a crash
of the process (only a power loss can take the last commits).

The connection is owned by one dedicated thread, and a whole append (BEGIN IMMEDIATE, read
the chain's head, seal, INSERT, COMMIT) is one plain :mod:`sqlite3` function run there: one
thread hop per batch instead of one per statement, which is most of what an append costs.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from stargrpc.audit.chain import seal
from stargrpc.audit.record import FIELDS, GENESIS_HASH, AuditRecord
from stargrpc.audit.store import (
    TABLE,
    Query,
    scan_in_batches,
    schema_sql,
    select_sql,
    sqlite_path,
)

_TYPES = {"seq": "INTEGER PRIMARY KEY", "id": "TEXT NOT NULL UNIQUE",
          "duration_ms": "REAL NOT NULL", "privileged": "INTEGER NOT NULL"}

_SCHEMA = schema_sql(_TYPES)

_INSERT = (f"INSERT INTO {TABLE} ({', '.join(FIELDS)}) "
           f"VALUES ({', '.join('?' for _ in FIELDS)})")

_HEAD = f"SELECT seq, hash FROM {TABLE} ORDER BY seq DESC LIMIT 1"

_T = TypeVar("_T")


class SqliteAuditStore:
    """An audit trail in a SQLite file.

    Attributes:
        url: ``sqlite:///PATH``.
    """

    url: str
    _db: sqlite3.Connection | None
    _thread: ThreadPoolExecutor | None

    def __init__(self, url: str) -> None:
        self.url = url
        self._db = None
        self._thread = None

    async def open(self) -> None:
        path = sqlite_path(self.url)
        path.parent.mkdir(parents=True, exist_ok=True)
        # One thread owns the connection: sqlite3's own same-thread check stays on.
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="audit-sqlite")
        try:
            self._db = await self._run(_connect, str(path))
        except BaseException:
            self._thread.shutdown(wait=False)
            self._thread = None
            raise

    async def _run(self, function: Callable[..., _T], *args: object) -> _T:
        if self._thread is None:
            raise RuntimeError("the audit store is not open")
        return await asyncio.get_running_loop().run_in_executor(self._thread, function, *args)

    @property
    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            raise RuntimeError("the audit store is not open")
        return self._db

    async def append(self, records: Sequence[AuditRecord]) -> list[AuditRecord]:
        return await self._run(_append, self._conn, records)

    async def query(self, query: Query) -> list[AuditRecord]:
        sql, params = select_sql(TABLE, query, "?")
        return await self._run(_select, self._conn, sql, params)

    def scan(self, batch: int = 1000) -> AsyncIterator[AuditRecord]:
        return scan_in_batches(self.query, batch)

    async def aclose(self) -> None:
        if self._thread is None:
            return
        if self._db is not None:
            await self._run(self._db.close)
            self._db = None
        self._thread.shutdown(wait=True)
        self._thread = None


# -- run on the store's thread -------------------------------------------------------------

def _connect(path: str) -> sqlite3.Connection:
    # isolation_level=None: transactions are spelled out (BEGIN IMMEDIATE … COMMIT).
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute("PRAGMA busy_timeout=10000")
        for statement in _SCHEMA:
            db.execute(statement)
    except BaseException:
        db.close()
        raise
    return db


def _append(db: sqlite3.Connection, records: Sequence[AuditRecord]) -> list[AuditRecord]:
    """Numbers, chains and inserts ``records`` in one exclusive transaction."""
    db.execute("BEGIN IMMEDIATE")
    try:
        # Read under the write lock: another process may have appended since our last batch.
        last = db.execute(_HEAD).fetchone()
        sealed = seal(records, last[0] if last else 0, last[1] if last else GENESIS_HASH)
        db.executemany(_INSERT, [_row(record) for record in sealed])
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    return sealed


def _select(db: sqlite3.Connection, sql: str, params: list[object]) -> list[AuditRecord]:
    cursor = db.execute(sql, params)
    names = [column[0] for column in cursor.description]
    return [AuditRecord.from_dict(dict(zip(names, row, strict=True)))
            for row in cursor.fetchall()]


def _row(record: AuditRecord) -> tuple[object, ...]:
    # Field by field: dataclasses.astuple deep-copies every value, which costs more here.
    values = (getattr(record, name) for name in FIELDS)
    return tuple(int(v) if isinstance(v, bool) else v for v in values)
