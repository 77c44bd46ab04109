"""Fixtures of the delivery tests: the Redis store tests' (a key prefix of their own, and a
Redis Cluster of the test's own), and the test CA's files for a receiver on loopback."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.auth.certs import TestCA
from tests.stores.conftest import redis_cluster, redis_prefix, replicas

__all__ = ["redis_cluster", "redis_prefix", "replicas", "tls"]


@pytest.fixture
def tls(tmp_path: Path) -> dict[str, Path]:
    """A server certificate, its key and the CA that issued them, in ``tmp_path``."""
    return TestCA().server_files(tmp_path)
