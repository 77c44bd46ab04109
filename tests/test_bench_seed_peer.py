"""The seed-design peer of ``python -m bench`` (``bench/seed_peer.py``) does what the seed
design does, on the shared Redis under a prefix of its own: a call is answered on the
caller's reply stream, a request sent again with the same idempotency key is answered from
the cached result without running the tool twice, and the worker deletes its keys when it
stops. Never its speed: that is the benchmark's to show."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio

from bench.seed_peer import SeedCaller, parse_address

ROOT = Path(__file__).resolve().parent.parent
REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture
def worker() -> Iterator[tuple[str, subprocess.Popen[str]]]:
    prefix = f"bench:seed:test-{uuid.uuid4().hex[:8]}:"
    proc = subprocess.Popen([sys.executable, "-m", "bench.seed_peer", "--redis-url",
                             REDIS_URL, "--prefix", prefix], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the worker says it serves once its group exists
        yield json.loads(line)["address"], proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.wait(20)


async def test_a_call_is_answered_and_a_repeated_request_comes_from_the_cache(
        worker: tuple[str, subprocess.Popen[str]]) -> None:
    address, proc = worker
    url, prefix = parse_address(address)
    caller = SeedCaller(url, prefix)
    db = redis.asyncio.Redis.from_url(url)
    try:
        assert (await caller.call("bench_trivial", seconds=20))["result"] == ""
        replies = await asyncio.gather(*(caller.call("bench_wait", {"ms": 5}, seconds=20)
                                         for _ in range(50)))
        assert all(reply["result"] == "" for reply in replies)
        assert "error" in await caller.call("no_such_tool", seconds=20)

        # The same request twice, with one idempotency key, as a redelivery would send it.
        reply_to = f"{prefix}reply:by-hand"
        request = json.dumps({"tool": "bench_wait", "arguments": {"ms": 1},
                              "correlation_id": "c1", "idem_key": "k1",
                              "reply_to": reply_to})
        last: str | bytes = "0-0"
        for attempt in range(2):
            await db.xadd(f"{prefix}requests", {"p": request})
            found = await db.xread({reply_to: last}, count=10, block=10_000)
            assert found
            last = found[0][1][-1][0]
            if attempt == 0:
                # Marked, so that a second answer taken from the cache shows where it came
                # from (a second run would answer "").
                assert await db.ttl(f"{prefix}result:k1") > 0
                await db.set(f"{prefix}result:k1", json.dumps(
                    {"correlation_id": "c1", "result": "from the cache"}), keepttl=True)
        replies_by_hand = [json.loads(fields[b"p"]) for _, fields in await db.xrange(reply_to)]
        assert replies_by_hand == [{"correlation_id": "c1", "result": ""},
                                   {"correlation_id": "c1", "result": "from the cache"}]
    finally:
        await caller.close()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0
    try:
        assert [key async for key in db.scan_iter(match=f"{prefix}*")] == []
    finally:
        await db.aclose()
