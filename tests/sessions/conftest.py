"""Fixtures of the session tests: a Redis key prefix of their own for the fleet tests."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture
async def session_prefix() -> AsyncIterator[str]:
    """A fresh Redis key prefix; every key under it is deleted after the test."""
    prefix = f"stargrpc-sessions-test:{uuid.uuid4().hex[:12]}:"
    yield prefix
    client = Redis.from_url(REDIS_URL)
    try:
        keys = [k async for k in client.scan_iter(match=f"{prefix}*", count=1000)]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()
