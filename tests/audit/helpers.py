"""What the audit tests share: a PostgreSQL schema of a test's own on the real server at
127.0.0.1:5432 (database ``test``), and SQL run on a store's database behind its back."""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg

from stargrpc.audit.store import sqlite_path

#: The PostgreSQL server the fleet-mode tests talk to (trust auth).
PG_BASE = "postgresql://postgres@127.0.0.1:5432/test"


@asynccontextmanager
async def pg_schema() -> AsyncIterator[str]:
    """A store URL on a PostgreSQL schema of its own, dropped afterwards."""
    schema = f"audit_test_{uuid.uuid4().hex[:12]}"
    conn = await asyncpg.connect(PG_BASE)
    try:
        await conn.execute(f"CREATE SCHEMA {schema}")
        yield f"{PG_BASE}?search_path={schema}"
    finally:
        await conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        await conn.close()


async def execute_raw(url: str, *statements: str) -> None:
    """Runs SQL on a store's database behind its back (to tamper with it)."""
    if url.startswith("sqlite"):
        with sqlite3.connect(sqlite_path(url)) as db:
            for statement in statements:
                db.execute(statement)
        return
    conn = await asyncpg.connect(url)
    try:
        async with conn.transaction():
            for statement in statements:
                await conn.execute(statement)
    finally:
        await conn.close()
