"""Run state costs (issue 27): ``python -m bench.state``.

Prints, for ``ctx.state`` as a tool calls it (:class:`~stargrpc.runs.state.RunState`, its
checks and JSON included):

- µs per ``get`` / ``set`` / ``increment`` / ``compare_and_set`` in memory (the embedded
  default; the target is 20 µs or less), in SQLite (``state_persist``), and on Redis
  (127.0.0.1:6379, keys under a prefix of its own, deleted at the end);
- the Redis round trips each operation makes (counted on the client's connection: the
  target is one), and
- µs per ``get`` / ``set`` of a sandboxed command through its state socket (the
  ``stargrpc_state`` client in this process, the server's socket on an event loop in a
  thread), the memory store behind it.

In-process, bounded (a fixed number of operations, best of five rounds), reported, never
asserted (no test times anything). ``--smoke`` is the tiniest pass.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.connection import Connection, ConnectionPool
from redis.exceptions import RedisError

from stargrpc.runs.state import RunState
from stargrpc.sandbox import state_client
from stargrpc.sandbox.state_socket import StateSocket
from stargrpc.settings import Settings
from stargrpc.stores.base import StateStore
from stargrpc.stores.memory import MemoryStateStore
from stargrpc.stores.redis.state import RedisStateStore
from stargrpc.stores.sqlite_state import SqliteStateStore

REDIS_URL = "redis://127.0.0.1:6379/0"
ROUNDS = 5


class _CountingConnection(Connection):
    """A Redis connection that counts what it sends: one write per round trip (a
    pipeline, or a script, is one)."""

    sent = 0

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        _CountingConnection.sent += 1
        await super().send_packed_command(command, check_health)


async def _per_op(operation: Callable[[int], Awaitable[object]], count: int) -> float:
    """µs per call of ``operation`` (best of :data:`ROUNDS` rounds of ``count``)."""
    best = float("inf")
    for _ in range(ROUNDS):
        started = time.perf_counter()
        for index in range(count):
            await operation(index)
        best = min(best, time.perf_counter() - started)
    return best / count * 1e6


def _operations(state: RunState) -> dict[str, Callable[[int], Awaitable[object]]]:
    value = {"seen": ["https://example.com/a", "https://example.com/b"], "n": 2}
    return {
        "set": lambda i: state.set(f"k{i % 100}", value),
        "get": lambda i: state.get(f"k{i % 100}"),
        "increment": lambda i: state.increment("n"),
        "compare_and_set": lambda i: state.compare_and_set(f"c{i}", None, 1),
    }


async def _measure(store: StateStore, count: int) -> dict[str, float]:
    settings = Settings(insecure_no_auth=True)
    state = RunState(store, "tree", f"tree:{uuid.uuid4().hex}", settings, writable=True)
    return {name: await _per_op(operation, count)
            for name, operation in _operations(state).items()}


async def _redis_round_trips(store: StateStore) -> dict[str, float]:
    settings = Settings(insecure_no_auth=True)
    state = RunState(store, "tree", f"tree:{uuid.uuid4().hex}", settings, writable=True)
    trips = {}
    for name, operation in _operations(state).items():
        await operation(10_000)  # the script is loaded (a first EVALSHA may need EVAL)
        before = _CountingConnection.sent
        for index in range(100):
            await operation(index)
        trips[name] = (_CountingConnection.sent - before) / 100
    return trips


def _socket_figures(count: int) -> dict[str, float]:
    """µs per get / set of a sandboxed command over its state socket."""
    settings = Settings(insecure_no_auth=True)
    store = MemoryStateStore()
    loop = asyncio.new_event_loop()
    made: dict[str, StateSocket] = {}
    ready = threading.Event()

    async def serve() -> None:
        made["socket"] = StateSocket(
            lambda scope: RunState(store, scope, f"{scope}:bench", settings, writable=True),
            scopes=["run", "tree"], requests_per_second=1e9, max_value_bytes=64 * 1024,
            client_dir=Path(tempfile.gettempdir()))
        ready.set()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(serve(), loop).result()
    ready.wait()
    channel = made["socket"]
    connection = state_client.Connection(channel.pass_fds[0])
    scope = state_client.Scope("tree", connection)
    figures = {}
    for name, operation in (("set", lambda i: scope.set(f"k{i % 100}", {"n": i})),
                            ("get", lambda i: scope.get(f"k{i % 100}"))):
        best = float("inf")
        for _ in range(ROUNDS):
            started = time.perf_counter()
            for index in range(count):
                operation(index)
            best = min(best, time.perf_counter() - started)
        figures[name] = best / count * 1e6
    connection.close()
    asyncio.run_coroutine_threadsafe(channel.aclose(), loop).result()
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.close()
    return figures


async def _redis_figures(count: int) -> tuple[dict[str, float], dict[str, float]] | None:
    prefix = f"bench:state:{uuid.uuid4().hex[:8]}:"
    client = Redis(connection_pool=ConnectionPool.from_url(
        REDIS_URL, connection_class=_CountingConnection))
    try:
        await client.ping()
    except (RedisError, OSError):
        await client.aclose()
        return None
    store = RedisStateStore(client, prefix=prefix)
    try:
        return await _measure(store, count), await _redis_round_trips(store)
    finally:
        async for key in client.scan_iter(match=f"{prefix}*"):
            await client.delete(key)
        await client.aclose()


async def _main(scale: float) -> None:
    print("run state (ctx.state, RunState with its checks): µs per operation, best of "
          f"{ROUNDS}")
    memory = await _measure(MemoryStateStore(), int(20_000 * scale))
    with tempfile.TemporaryDirectory() as folder:
        sqlite = SqliteStateStore(Path(folder) / "state.db")
        persisted = await _measure(sqlite, int(2_000 * scale))
        sqlite.close()
    redis = await _redis_figures(int(500 * scale))
    socket_figures = await asyncio.to_thread(_socket_figures, int(2_000 * scale))
    print(f"{'operation':<16}{'memory':>10}{'sqlite':>10}{'redis':>10}{'redis trips':>13}"
          f"{'socket':>10}")
    for name in memory:
        on_redis = f"{redis[0][name]:10.1f}{redis[1][name]:13.2f}" if redis else \
            f"{'-':>10}{'-':>13}"
        over_socket = (f"{socket_figures[name]:10.1f}" if name in socket_figures
                       else f"{'-':>10}")
        print(f"{name:<16}{memory[name]:10.1f}{persisted[name]:10.1f}{on_redis}{over_socket}")
    if redis is None:
        print("(redis: not measured, nothing answers at 127.0.0.1:6379)")


if __name__ == "__main__":
    # --smoke: a tiny pass (what tests/test_bench_state.py runs, so the code cannot rot).
    asyncio.run(_main(0.01 if "--smoke" in sys.argv[1:] else 1.0))
