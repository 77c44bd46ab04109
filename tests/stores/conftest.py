"""Fixtures of the Redis store tests: the real Redis on 127.0.0.1:6379, a key prefix of
their own per test (deleted afterwards), and servers sharing it."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture
async def redis_prefix() -> AsyncIterator[str]:
    """A fresh key prefix; every key under it is deleted after the test."""
    prefix = f"stargrpc-test:{uuid.uuid4().hex[:12]}:"
    yield prefix
    client = Redis.from_url(REDIS_URL)
    try:
        keys = [k async for k in client.scan_iter(match=f"{prefix}*", count=1000)]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


@pytest.fixture
async def replicas(make_server, redis_prefix: str):
    """A factory of in-process replicas sharing Redis under this test's prefix."""
    from tests.runs_support import HeaderPrincipal, run_registry

    async def start(**overrides):
        return await make_server(registry=run_registry(), interceptors=[HeaderPrincipal()],
                                 redis_url=REDIS_URL, redis_key_prefix=redis_prefix,
                                 **overrides)

    return start
