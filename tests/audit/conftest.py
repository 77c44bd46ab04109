"""Audit store fixtures: a SQLite file per test, and a PostgreSQL schema per test on the
real server at 127.0.0.1:5432 (database ``test``), dropped afterwards."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from stargrpc.audit.store import AuditStore, open_store
from tests.audit.helpers import pg_schema


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
