"""Fixtures of the Redis store tests: the real Redis on 127.0.0.1:6379, a key prefix of
their own per test (deleted afterwards), servers sharing it, and a redis-server of a test's
own that it can stall."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

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


class StallableRedis:
    """A redis-server of the test's own on a free loopback port, which the test can stall
    (SIGSTOP), resume (SIGCONT) and kill: the shared Redis on 6379 is never touched."""

    port: int
    url: str
    proc: subprocess.Popen[bytes] | None

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.proc = None
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = int(probe.getsockname()[1])
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Starts the server (again, empty, after a kill) and waits until it answers."""
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.folder)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # up once it answers PING
            ping = subprocess.run(["redis-cli", "-p", str(self.port), "ping"],
                                  capture_output=True, text=True, timeout=10)
            if ping.stdout.strip() == "PONG":
                return
            time.sleep(0.05)
        raise AssertionError("redis-server did not come up")

    def stall(self) -> None:
        """Freezes the server: connections stay open, nothing is answered."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """Lets a stalled server go on (it then serves what queued up meanwhile)."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        """Kills the server (stalled or not); its data is gone."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture
def stallable_redis(tmp_path: Path) -> Iterator[StallableRedis]:
    """A started :class:`StallableRedis`, killed by its PID afterwards."""
    redis = StallableRedis(tmp_path)
    redis.start()
    try:
        yield redis
    finally:
        redis.kill()
