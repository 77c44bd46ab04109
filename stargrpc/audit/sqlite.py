"""The SQLite audit store: one file in WAL mode, the embedded default.

WAL lets readers (``stargrpc audit tail``) run while the server writes; ``BEGIN IMMEDIATE``
makes each append exclusive among writers, so two processes sharing the file still build
one chain. ``synchronous=NORMAL`` in WAL mode keeps every committed record across a crash
of the process (only a power loss can take the last commits).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence

import aiosqlite

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


class SqliteAuditStore:
    """An audit trail in a SQLite file.

    Attributes:
        url: ``sqlite:///PATH``.
    """

    url: str
    _db: aiosqlite.Connection | None

    def __init__(self, url: str) -> None:
        self.url = url
        self._db = None

    async def open(self) -> None:
        path = sqlite_path(self.url)
        path.parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: transactions are spelled out (BEGIN IMMEDIATE … COMMIT).
        self._db = await aiosqlite.connect(path, isolation_level=None)
        self._db.row_factory = aiosqlite.Row
        await self._db.execute("PRAGMA journal_mode=WAL")
        await self._db.execute("PRAGMA synchronous=NORMAL")
        await self._db.execute("PRAGMA busy_timeout=10000")
        for statement in _SCHEMA:
            await self._db.execute(statement)

    @property
    def _conn(self) -> aiosqlite.Connection:
        if self._db is None:
            raise RuntimeError("the audit store is not open")
        return self._db

    async def append(self, records: Sequence[AuditRecord]) -> list[AuditRecord]:
        db = self._conn
        await db.execute("BEGIN IMMEDIATE")
        try:
            async with db.execute(
                    f"SELECT seq, hash FROM {TABLE} ORDER BY seq DESC LIMIT 1") as cursor:
                last = await cursor.fetchone()
            sealed = seal(records, last["seq"] if last else 0,
                          last["hash"] if last else GENESIS_HASH)
            await db.executemany(_INSERT, [_row(record) for record in sealed])
            await db.execute("COMMIT")
        except BaseException:
            await db.execute("ROLLBACK")
            raise
        return sealed

    async def query(self, query: Query) -> list[AuditRecord]:
        sql, params = select_sql(TABLE, query, "?")
        async with self._conn.execute(sql, params) as cursor:
            return [AuditRecord.from_dict(dict(row)) for row in await cursor.fetchall()]

    def scan(self, batch: int = 1000) -> AsyncIterator[AuditRecord]:
        return scan_in_batches(self.query, batch)

    async def aclose(self) -> None:
        if self._db is not None:
            await self._db.close()
            self._db = None


def _row(record: AuditRecord) -> tuple[object, ...]:
    values = dataclasses.astuple(record)
    return tuple(int(v) if isinstance(v, bool) else v for v in values)
