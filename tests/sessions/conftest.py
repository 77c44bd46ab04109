"""Fixtures of the session tests: the Redis store tests' key prefix, a Redis of the test's
own it can stall, and a Redis Cluster, for the fleet tests."""

from __future__ import annotations

from tests.stores.conftest import REDIS_URL, redis_cluster, redis_prefix, stallable_redis

__all__ = ["REDIS_URL", "redis_cluster", "redis_prefix", "stallable_redis"]
