"""Fixtures of the delivery tests: the Redis store tests' (a key prefix of their own)."""

from tests.stores.conftest import redis_prefix, replicas

__all__ = ["redis_prefix", "replicas"]
