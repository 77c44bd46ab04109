"""Audit store fixtures: a SQLite file per test, and a PostgreSQL schema per test on the
real server at 127.0.0.1:5432 (database ``test``), dropped afterwards."""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import asyncpg
import pytest

from stargrpc.audit.store import AuditStore, open_store, sqlite_path

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


@pytest.fixture
async def pg_url() -> AsyncIterator[str]:
    """A PostgreSQL store URL on a schema of its own, dropped after the test."""
    async with pg_schema() as url:
        yield url


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A store URL on a fresh SQLite file."""
    return f"sqlite:///{tmp_path / 'audit.db'}"


@pytest.fixture(params=["sqlite", "postgresql"])
async def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    """Each test that takes it runs against both stores."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'audit.db'}"
        return
    async with pg_schema() as url:
        yield url


@pytest.fixture
async def store(store_url: str) -> AsyncIterator[AuditStore]:
    """An open store of either kind."""
    opened = open_store(store_url)
    await opened.open()
    yield opened
    await opened.aclose()


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
