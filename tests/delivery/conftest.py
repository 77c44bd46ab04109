"""Fixtures of the delivery tests: the Redis store tests' (a key prefix of their own, and a
Redis Cluster of the test's own)."""

from tests.stores.conftest import redis_cluster, redis_prefix, replicas

__all__ = ["redis_cluster", "redis_prefix", "replicas"]
