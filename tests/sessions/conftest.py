"""Fixtures of the session tests: the Redis store tests' key prefix, for the fleet tests."""

from __future__ import annotations

from tests.stores.conftest import REDIS_URL, redis_prefix

__all__ = ["REDIS_URL", "redis_prefix"]
