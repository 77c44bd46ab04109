"""The PostgreSQL audit store (asyncpg), for replicas that share one trail.

Each append takes a transaction-scoped advisory lock, reads the head of the chain and
copies the batch in, so appends from any number of replicas form one gapless chain. Query
parameters of the URL that asyncpg does not know (``?search_path=audit``) are sent to the
server as settings, which is how a deployment (or a test) picks the schema.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence

import asyncpg

from stargrpc.audit.chain import seal
from stargrpc.audit.record import FIELDS, GENESIS_HASH, AuditRecord
from stargrpc.audit.store import (
    TABLE,
    Query,
    scan_in_batches,
    schema_sql,
    select_sql,
)

_TYPES = {"seq": "BIGINT PRIMARY KEY", "id": "TEXT NOT NULL UNIQUE",
          "duration_ms": "DOUBLE PRECISION NOT NULL", "privileged": "BOOLEAN NOT NULL"}

_SCHEMA = schema_sql(_TYPES)

# One lock per schema-qualified table: writers of the same trail take turns.
_LOCK = f"SELECT pg_advisory_xact_lock(hashtext(current_schema() || '.{TABLE}'))"


class PostgresAuditStore:
    """An audit trail in a PostgreSQL table.

    Attributes:
        url: ``postgresql://user[:password]@host[:port]/database[?search_path=schema]``.
    """

    url: str
    _pool: asyncpg.Pool | None

    def __init__(self, url: str) -> None:
        self.url = url
        self._pool = None

    async def open(self) -> None:
        self._pool = await asyncpg.create_pool(self.url, min_size=1, max_size=4)
        async with self._pool.acquire() as conn, conn.transaction():
            await conn.execute(_LOCK)  # two replicas starting at once: one creates
            for statement in _SCHEMA:
                await conn.execute(statement)

    @property
    def _db(self) -> asyncpg.Pool:
        if self._pool is None:
            raise RuntimeError("the audit store is not open")
        return self._pool

    async def append(self, records: Sequence[AuditRecord]) -> list[AuditRecord]:
        async with self._db.acquire() as conn, conn.transaction():
            await conn.execute(_LOCK)
            last = await conn.fetchrow(
                f"SELECT seq, hash FROM {TABLE} ORDER BY seq DESC LIMIT 1")
            sealed = seal(records, last["seq"] if last else 0,
                          last["hash"] if last else GENESIS_HASH)
            await conn.copy_records_to_table(
                TABLE, records=[dataclasses.astuple(r) for r in sealed], columns=list(FIELDS))
        return sealed

    async def query(self, query: Query) -> list[AuditRecord]:
        sql, params = select_sql(TABLE, query, "$")
        rows = await self._db.fetch(sql, *params)
        return [AuditRecord.from_dict(dict(row)) for row in rows]

    def scan(self, batch: int = 1000) -> AsyncIterator[AuditRecord]:
        return scan_in_batches(self.query, batch)

    async def aclose(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None
