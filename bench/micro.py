"""Micro-measurements behind the optimisations in ``bench/README.md``:
``python -m bench.micro``. Each line is the cost of one operation of the hot path, next to
the ways it was written before or could be: per-event protobuf work, an audit transaction on
SQLite, and the Redis round trips of a run (against 127.0.0.1:6379, under a key prefix of
its own that it deletes). In-process, bounded (a fixed number of repetitions), and never used
by a test.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import sqlite3
import tempfile
import time
import timeit
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiosqlite
from redis.asyncio import Redis
from redis.exceptions import RedisError

from stargrpc.stores.redis import FlushConnection
from stargrpc.v1 import events_pb2, tool_service_pb2

REPEAT = 20_000


def _us(fn: Callable[[], object]) -> float:
    # The best of 5 rounds: the least-disturbed figure on a shared machine.
    return min(timeit.repeat(fn, number=REPEAT, repeat=5)) / REPEAT * 1e6


def _delta_event() -> events_pb2.RunEvent:
    event = events_pb2.RunEvent(run_id="0" * 32, seq=12345)
    event.time.GetCurrentTime()
    event.critic_time_left.FromMilliseconds(89_999)
    event.step.phase = events_pb2.STEP_PHASE_DELTA
    event.step.step.id = "s0"
    event.step.delta = "0000001\n"
    return event


def main() -> None:
    event = _delta_event()

    def stamp_wkt() -> None:
        event.time.GetCurrentTime()

    def stamp_ns() -> None:
        seconds, nanos = divmod(time.time_ns(), 1_000_000_000)
        event.time.seconds = seconds
        event.time.nanos = nanos

    def countdown_wkt() -> None:
        event.critic_time_left.FromMilliseconds(89_999)

    def countdown_fields() -> None:
        left = event.critic_time_left
        left.seconds, left.nanos = divmod(89_999, 1000)
        left.nanos *= 1_000_000

    def serialize() -> None:
        event.SerializeToString()

    def wrap_and_serialize() -> None:
        tool_service_pb2.ExecuteResponse(event=event).SerializeToString()

    deltas = [f"{i:07d}\n" for i in range(10)]

    def ten_messages() -> None:
        for text in deltas:
            one = events_pb2.RunEvent(run_id="0" * 32, seq=1)
            one.step.delta = text
            one.SerializeToString()

    def one_coalesced() -> None:
        one = events_pb2.RunEvent(run_id="0" * 32, seq=1)
        one.step.delta = "".join(deltas)
        one.SerializeToString()

    rows = [
        ("event.time.GetCurrentTime() (protobuf's helper)", stamp_wkt),
        ("time.time_ns() into seconds/nanos (what runs do)", stamp_ns),
        ("critic_time_left.FromMilliseconds() (no gain to have)", countdown_wkt),
        ("critic_time_left seconds/nanos set directly", countdown_fields),
        ("RunEvent.SerializeToString() (a delta event)", serialize),
        ("ExecuteResponse(event=…) + serialize (what each send costs)", wrap_and_serialize),
        ("10 delta events built and serialized", ten_messages),
        ("1 event carrying the same 10 deltas (coalesced)", one_coalesced),
    ]
    width = 64
    for name, fn in rows:
        print(f"{name:<{width}}  {_us(fn):8.2f} µs")
    for name, cpu, wall in asyncio.run(_io_costs()):
        print(f"{name:<{width}}  {cpu:8.1f} µs CPU  {wall:8.1f} µs wall")


ROUNDS = 300


async def _per_op(op: Callable[[], Awaitable[object]]) -> tuple[float, float]:
    """CPU (every thread of the process) and wall time per call of ``op``, in µs."""
    for _ in range(20):
        await op()
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(ROUNDS):
        await op()
    return ((time.process_time() - cpu) / ROUNDS * 1e6,
            (time.perf_counter() - wall) / ROUNDS * 1e6)


_TABLE = "CREATE TABLE audit (seq INTEGER PRIMARY KEY, hash TEXT, record TEXT)"
_RECORD = '{"method": "/stargrpc.v1.ToolService/Execute", "tool": "bench_trivial"}' * 4


async def _audit_costs(folder: Path) -> list[tuple[str, float, float]]:
    """One audit record per transaction, as sequential calls make them: the statements
    awaited one by one through aiosqlite (the first design), the whole transaction in one
    hop to a writer thread (the second), or run right on the event loop (what the store does
    now, with its thread only as the fallback when another writer holds the lock)."""
    db = await aiosqlite.connect(folder / "now.db", isolation_level=None)
    await db.execute("PRAGMA journal_mode=WAL")
    await db.execute("PRAGMA synchronous=NORMAL")
    await db.execute(_TABLE)

    async def now() -> None:
        await db.execute("BEGIN IMMEDIATE")
        async with db.execute("SELECT seq, hash FROM audit ORDER BY seq DESC LIMIT 1") as cur:
            last = await cur.fetchone()
        seq = (last[0] if last else 0) + 1
        await db.executemany("INSERT INTO audit VALUES (?, ?, ?)", [(seq, "h", _RECORD)])
        await db.execute("COMMIT")

    conn = sqlite3.connect(folder / "one_hop.db", isolation_level=None,
                           check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute(_TABLE)
    state = {"seq": 0}

    def transaction() -> None:
        conn.execute("BEGIN IMMEDIATE")
        state["seq"] += 1
        conn.executemany("INSERT INTO audit VALUES (?, ?, ?)", [(state["seq"], "h", _RECORD)])
        conn.execute("COMMIT")

    writer = concurrent.futures.ThreadPoolExecutor(1)
    loop = asyncio.get_running_loop()

    async def one_hop() -> None:
        await loop.run_in_executor(writer, transaction)

    async def on_the_loop() -> None:
        transaction()

    try:
        return [("audit: a 1-record transaction, 5 aiosqlite awaits (first)", *await _per_op(now)),
                ("audit: the same in one hop to a writer thread (second)",
                 *await _per_op(one_hop)),
                ("audit: the same on the event loop (now)", *await _per_op(on_the_loop))]
    finally:
        await db.close()
        writer.shutdown()
        conn.close()


async def _redis_costs() -> list[tuple[str, float, float]]:
    """The client-side cost of the Redis round trips a run makes: registering it (a MULTI of
    three commands, the first design) and appending events with a script through the pooled
    client or on a connection driven directly (what the flusher does now), next to one bare
    round trip."""
    redis = Redis.from_url("redis://127.0.0.1:6379/0", socket_timeout=5)
    prefix = f"stargrpc-bench-micro:{uuid.uuid4().hex}:"
    append = redis.register_script(
        "for i = 1, #ARGV do redis.call('XADD', KEYS[1], '*', 'e', ARGV[i]) end return 1")
    event = _delta_event().SerializeToString()
    counter = {"n": 0}

    async def publish() -> None:
        counter["n"] += 1
        key = f"{prefix}{counter['n']}"
        async with redis.pipeline(transaction=True) as pipe:
            pipe.set(key + ":lease", "token", px=60_000)
            pipe.hset(key, mapping={"owner": "bench", "tool": "bench_trivial",
                                    "replica": "r", "state": "running"})
            pipe.pexpire(key, 60_000)
            await pipe.execute()

    async def flush() -> None:
        await append(keys=[f"{prefix}events"], args=[event, event, event])

    async def ping() -> None:
        await redis.ping()

    line = FlushConnection(redis)

    async def flush_direct() -> None:
        await line.call_all(append.sha, [([f"{prefix}events"], [event, event, event])])

    try:
        return [("redis: register a run, MULTI of SET+HSET+PEXPIRE (first)",
                 *await _per_op(publish)),
                ("redis: append 3 events with EVALSHA, pooled client", *await _per_op(flush)),
                ("redis: the same on a connection driven directly (now)",
                 *await _per_op(flush_direct)),
                ("redis: one bare round trip (PING), the floor", *await _per_op(ping))]
    finally:
        await line.aclose()
        keys = [key async for key in redis.scan_iter(match=prefix + "*", count=1000)]
        for start in range(0, len(keys), 500):
            await redis.delete(*keys[start:start + 500])
        await redis.aclose()


async def _io_costs() -> list[tuple[str, float, float]]:
    with tempfile.TemporaryDirectory(prefix="stargrpc-micro-") as folder:
        rows = await _audit_costs(Path(folder))
    with contextlib.suppress(RedisError, OSError):
        rows += await _redis_costs()
    return rows


if __name__ == "__main__":
    main()
