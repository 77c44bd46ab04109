"""The bare baseline: grpc.aio with one server-streaming method and no framework at all.

It serves ``stargrpc.v1.ToolService/Execute`` so that the very same client code drives it and
stargrpc, and answers the benchmark tools' names (``bench/tools``) with the same messages
stargrpc sends — real ``stargrpc.v1`` RunEvents, built per message with the same fields and
sizes (START, the deltas, END, Result) — but with nothing in between: no interceptors, no
argument validation, no run, no event log. It is the limit a Python gRPC service reaches
on this machine.

With ``--floor`` it is the **floor** instead: the same server plus only the I/O that
stargrpc's layers must do on every Execute, done as leanly as Python allows — the API key
checked (SHA-256, constant-time compare against ``BENCH_FLOOR_TOKEN``), the run's events
written to Redis in one background script call (``--redis-url``; batches of at most 1 MiB),
and one audit row committed to a WAL-mode SQLite file (in ``--state-dir``) on the event loop
before the Result is sent. What stargrpc costs beyond the floor is the framework;
what the floor costs beyond the bare server no stargrpc with those layers can avoid.
``--floor-without LAYER`` (``audit``, ``run-log`` or ``auth``; repeatable) skips that
layer's I/O, so that the floor's cost of each layer can be measured on its own.

Run: ``python -m bench.baseline_server --port 0 [--floor [--floor-without LAYER]...]``; it
prints one JSON line
``{"event": "serving", "address": "127.0.0.1:PORT"}`` once it accepts calls.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import hashlib
import hmac
import json
import os
import signal
import sqlite3
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import hiredis
import redis.asyncio

from stargrpc.v1 import events_pb2, tool_service_pb2

_SERVICE = "stargrpc.v1.ToolService"
#: The floor's layers that ``--floor-without`` can switch off, each with its own I/O.
FLOOR_LAYERS = ("audit", "run-log", "auth")


class _Events:
    """Builds one run's events the way stargrpc shapes them, one fresh message each."""

    def __init__(self, tool_name: str) -> None:
        self.tool_name = tool_name
        self.run_id = uuid.uuid4().hex
        self.seq = 0
        self.started = time.monotonic()
        self.started_at: Any = None

    def _event(self) -> tool_service_pb2.ExecuteResponse:
        self.seq += 1
        response = tool_service_pb2.ExecuteResponse()
        event = response.event
        event.run_id = self.run_id
        event.seq = self.seq
        event.time.GetCurrentTime()
        # stargrpc's events carry the critic's countdown: the same field, the same size.
        event.critic_time_left.seconds = 89
        event.critic_time_left.nanos = 999_000_000
        return response

    def _root(self, step: events_pb2.Step, status: int) -> None:
        step.id = "s0"
        step.kind = "bench"
        step.title = self.tool_name
        step.status = status  # type: ignore[assignment]

    def start(self) -> tool_service_pb2.ExecuteResponse:
        response = self._event()
        message = response.event.step
        message.phase = events_pb2.STEP_PHASE_START
        self._root(message.step, events_pb2.STEP_STATUS_RUNNING)
        message.step.started_at.CopyFrom(response.event.time)
        self.started_at = response.event.time
        return response

    def delta(self, text: str) -> tool_service_pb2.ExecuteResponse:
        response = self._event()
        message = response.event.step
        message.phase = events_pb2.STEP_PHASE_DELTA
        message.step.id = "s0"
        message.delta = text
        return response

    def end(self) -> tool_service_pb2.ExecuteResponse:
        response = self._event()
        message = response.event.step
        message.phase = events_pb2.STEP_PHASE_END
        self._root(message.step, events_pb2.STEP_STATUS_COMPLETE)
        message.step.started_at.CopyFrom(self.started_at)
        message.step.ended_at.CopyFrom(response.event.time)
        return response

    def result(self, output: str) -> tool_service_pb2.ExecuteResponse:
        response = self._event()
        result = response.event.result
        result.outcome = events_pb2.OUTCOME_OK
        result.output = output
        result.duration.FromNanoseconds(int((time.monotonic() - self.started) * 1e9))
        return response


async def execute(request: tool_service_pb2.ExecuteRequest,
                  context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
    """The bare streaming method: the benchmark tools' messages, nothing else."""
    arguments = json.loads(request.arguments_json or "{}")
    events = _Events(request.tool_name)
    yield events.start()
    output = ""
    if request.tool_name == "bench_stream":
        n = int(arguments.get("n", 20_000))
        # coalesce > 1 packs that many deltas into one message: what a server coalescing
        # deltas under backpressure could reach, measured on the bare transport.
        per_message = max(1, int(arguments.get("coalesce", 1)))
        for first in range(1, n + 1, per_message):
            last = min(n, first + per_message - 1)
            yield events.delta("".join(f"{i:07d}\n" for i in range(first, last + 1)))
        output = f"streamed {n}"
    elif request.tool_name == "bench_wait":
        await asyncio.sleep(float(arguments.get("ms", 10.0)) / 1000)
    elif request.tool_name == "bench_hold":
        await asyncio.sleep(float(arguments.get("seconds", 30.0)))
    elif request.tool_name != "bench_trivial":
        await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown tool {request.tool_name!r}")
    yield events.end()
    yield events.result(output)


# -- the floor ----------------------------------------------------------------------------

#: One audit transaction takes at most this many rows (what queued while the last committed).
_AUDIT_BATCH = 512
#: One Redis call carries at most this many bytes of events.
_RUNLOG_BATCH_BYTES = 1 << 20
_AUDIT_SCHEMA = ("CREATE TABLE IF NOT EXISTS audit (seq INTEGER PRIMARY KEY, "
                 "record TEXT NOT NULL, hash TEXT NOT NULL)")
_AUDIT_INSERT = "INSERT INTO audit (record, hash) VALUES (?, ?)"
# XADD every event of the batch to the run's stream and keep it 60 s: one round trip.
_RUNLOG_APPEND = """
for i = 1, #ARGV do redis.call('XADD', KEYS[1], '*', 'e', ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], 60000)
"""

_Waiter = asyncio.Future[None] | None


class AuditWriter:
    """A WAL-mode SQLite connection on the event loop, appending hash-chained rows.

    Rows queued within one turn of the event loop are committed together by one callback
    (one ``BEGIN IMMEDIATE … COMMIT`` for all) right on the loop: in WAL mode with
    ``synchronous=NORMAL`` a commit appends a few pages to the WAL in the page cache, and
    handing it to a thread instead costs more in thread switches than the commit itself
    (measured on stargrpc's own store: the audit's CPU per call fell from about 400 µs to
    about 190 µs when its commits moved from a thread onto the loop).
    """

    def __init__(self, path: Path, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._db = sqlite3.connect(str(path), isolation_level=None)  # BEGIN/COMMIT explicit
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(_AUDIT_SCHEMA)
        self._queue: list[tuple[str, _Waiter]] = []
        self._scheduled = False
        self._head = bytes(32)  # the chain's last hash: this connection is the only writer

    def append(self, row: str) -> asyncio.Future[None]:
        """Queues a row; the future is done once its transaction committed."""
        waiter: asyncio.Future[None] = self._loop.create_future()
        self._queue.append((row, waiter))
        self._schedule()
        return waiter

    def append_nowait(self, row: str) -> None:
        """Queues a row for a call that sent no Result, so nobody waits on its commit."""
        self._queue.append((row, None))
        self._schedule()

    def close(self) -> None:
        """Commits what is queued, then closes the database."""
        while self._queue:
            self._commit_queued()
        self._db.close()

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._commit_queued)

    def _commit_queued(self) -> None:
        self._scheduled = False
        batch, self._queue = self._queue[:_AUDIT_BATCH], self._queue[_AUDIT_BATCH:]
        if self._queue:
            self._schedule()
        if not batch:
            return
        rows = []
        chained = self._head
        for row, _ in batch:
            chained = hashlib.sha256(chained + row.encode()).digest()
            rows.append((row, chained.hex()))
        error: BaseException | None = None
        try:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.executemany(_AUDIT_INSERT, rows)
            self._db.execute("COMMIT")
            self._head = chained
        except sqlite3.Error as exc:
            if self._db.in_transaction:
                self._db.rollback()
            error = exc
        for _, waiter in batch:
            if waiter is not None and not waiter.done():  # a cancelled call no longer waits
                if error is None:
                    waiter.set_result(None)
                else:
                    waiter.set_exception(error)


class RunLog:
    """Runs' events in Redis streams, written off the Result's path by one writer task that
    sends everything pending in one round trip, on a connection of its own driven directly
    (no pool, lock or socket-timeout task per command: the leanest redis-py allows)."""

    def __init__(self, client: redis.asyncio.Redis, sha: str) -> None:
        self._client = client
        self._sha = sha
        self._pending: list[tuple[str, list[bytes]]] = []
        self._wanted = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._writer = asyncio.get_running_loop().create_task(self._write_pending())

    @classmethod
    async def connect(cls, url: str) -> RunLog:
        """A run log on the Redis at ``url``, its script loaded."""
        client = redis.asyncio.Redis.from_url(url, socket_timeout=None)
        return cls(client, await client.script_load(_RUNLOG_APPEND))

    def write(self, run_id: str, events: list[bytes]) -> None:
        """Appends serialised events to the run's stream, in the background."""
        self._pending.append((run_id, events))
        self._idle.clear()
        self._wanted.set()

    async def _write_pending(self) -> None:
        conn = await self._client.connection_pool.get_connection()
        try:
            while True:
                await self._wanted.wait()
                self._wanted.clear()
                batch, self._pending = self._pending, []
                commands = [("EVALSHA", self._sha, 1, f"bench:floor:{run_id}", *events)
                            for run_id, events in batch]
                try:
                    # Packed by hiredis in C, as stargrpc's flusher packs them.
                    await conn.send_packed_command(
                        [hiredis.pack_command(command) for command in commands],
                        check_health=False)
                    for _ in commands:
                        await conn.read_response()
                except redis.RedisError:
                    # A measurement aid, not a store: the batch is dropped, the connection
                    # starts clean (it reconnects on the next send).
                    await conn.disconnect(nowait=True)
                if not self._pending:
                    self._idle.set()
        finally:
            await self._client.connection_pool.release(conn)

    async def close(self) -> None:
        """Waits (10 s at most) for the writes under way, then disconnects."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), 10.0)
        self._writer.cancel()
        with contextlib.suppress(asyncio.CancelledError, redis.RedisError):
            await self._writer
        await self._client.aclose()


class Floor:
    """The bare server's Execute plus the minimum I/O of stargrpc's layers.

    A layer given as None (``audit``, ``run_log``) or switched off (``auth``) does none of
    its work at all, so that the floor with it off measures what that layer's I/O costs.
    """

    def __init__(self, token: str, audit: AuditWriter | None, run_log: RunLog | None,
                 auth: bool = True) -> None:
        self._auth = auth
        self._expected = hashlib.sha256(token.encode()).digest() if token and auth else None
        self._audit = audit
        self._run_log = run_log

    async def close(self) -> None:
        """Finishes the run log's writes under way and commits the audit rows queued."""
        if self._run_log is not None:
            await self._run_log.close()
        if self._audit is not None:
            self._audit.close()

    def _principal(self, context: grpc.aio.ServicerContext) -> str | None:
        """Who is calling (the key's hash prefix), or None when the key is wrong."""
        if not self._auth:
            return "anonymous"  # auth off: the metadata is not even read
        sent = ""
        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                sent = value if isinstance(value, str) else value.decode()
                break
        token = sent[7:] if sent.startswith("Bearer ") else ""
        digest = hashlib.sha256(token.encode()).digest()
        if self._expected is not None and not hmac.compare_digest(digest, self._expected):
            return None
        return f"key:{digest.hex()[:16]}" if token else "anonymous"

    @staticmethod
    def _row(request: tool_service_pb2.ExecuteRequest, context: grpc.aio.ServicerContext,
             principal: str, run_id: str, outcome: str, started: float) -> str:
        return json.dumps({
            "method": f"/{_SERVICE}/Execute", "tool": request.tool_name,
            "peer": context.peer(), "principal": principal, "run_id": run_id,
            "outcome": outcome, "duration_ms": round((time.perf_counter() - started) * 1e3, 3),
            "time_ns": time.time_ns()}, separators=(",", ":"))

    async def execute(self, request: tool_service_pb2.ExecuteRequest,
                      context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        """The bare method's messages, sent serialised once, with the layers' I/O around."""
        started = time.perf_counter()
        audit = self._audit
        principal = self._principal(context)
        if principal is None:
            if audit is not None:
                audit.append_nowait(self._row(request, context, "", "", "UNAUTHENTICATED",
                                              started))
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "invalid API key")
            return  # abort() raises: never reached
        pending: list[bytes] = []  # events not yet handed to the run log
        size = 0
        run_id = ""
        outcome = ""  # set once the Result's row is committed
        try:
            async for response in execute(request, context):
                data = response.SerializeToString()
                event = response.event
                run_id = event.run_id
                if self._run_log is not None:
                    if size + len(data) > _RUNLOG_BATCH_BYTES:
                        self._run_log.write(run_id, pending)
                        pending, size = [], 0
                    pending.append(data)
                    size += len(data)
                if event.HasField("result"):
                    if self._run_log is not None:
                        self._run_log.write(run_id, pending)
                        pending = []
                    outcome = events_pb2.Outcome.Name(event.result.outcome)
                    if audit is not None:
                        # stargrpc's promise: a Result the client saw has its record
                        # committed.
                        await audit.append(self._row(request, context, principal, run_id,
                                                     outcome, started))
                yield data
        except BaseException as exc:
            if not outcome:  # ended before its Result: recorded, but nobody to wait for it
                outcome = type(exc).__name__
                if audit is not None:
                    audit.append_nowait(self._row(request, context, principal, run_id,
                                                  outcome, started))
            raise
        finally:
            if pending and self._run_log is not None:
                self._run_log.write(run_id, pending)


async def _open_floor(state_dir: Path, redis_url: str, without: frozenset[str]) -> Floor:
    # A layer switched off opens nothing: no database, no Redis connection.
    audit = None
    if "audit" not in without:
        audit = AuditWriter(state_dir / "floor-audit.db", asyncio.get_running_loop())
    run_log = (await RunLog.connect(redis_url) if redis_url and "run-log" not in without
               else None)
    return Floor(os.environ.get("BENCH_FLOOR_TOKEN", ""), audit, run_log,
                 auth="auth" not in without)


async def serve(host: str, port: int, floor_dir: Path | None = None,
                redis_url: str = "", without: frozenset[str] = frozenset()) -> None:
    """Serves until SIGTERM or SIGINT; with ``floor_dir``, as the floor (module docstring),
    its audit database in that directory and its run log on ``redis_url`` (none if empty),
    less the I/O of the layers in ``without`` (of ``FLOOR_LAYERS``)."""
    server = grpc.aio.server()
    floor = (await _open_floor(floor_dir, redis_url, without) if floor_dir is not None
             else None)
    if floor is None:
        method = grpc.unary_stream_rpc_method_handler(
            execute,
            request_deserializer=tool_service_pb2.ExecuteRequest.FromString,
            response_serializer=tool_service_pb2.ExecuteResponse.SerializeToString,
        )
    else:
        # The floor serialises each event once, for Redis and the wire alike.
        method = grpc.unary_stream_rpc_method_handler(
            floor.execute, request_deserializer=tool_service_pb2.ExecuteRequest.FromString)
    handler = grpc.method_handlers_generic_handler(_SERVICE, {"Execute": method})
    server.add_generic_rpc_handlers((handler,))
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    # The same collector settings as `stargrpc serve` (stargrpc.server.tune_garbage_collector):
    # a deployment tweak any Python server can make, so the baseline makes it too.
    gc.collect()
    gc.freeze()
    gc.set_threshold(5_000, 20, 20)
    print(json.dumps({"event": "serving", "address": f"{host}:{bound}"}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1.0)
    if floor is not None:
        await floor.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.baseline_server",
                                     description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--floor", action="store_true",
                        help="Serve as the floor: add the minimum I/O of stargrpc's layers "
                             "(API key from env BENCH_FLOOR_TOKEN; empty accepts anyone).")
    parser.add_argument("--state-dir", type=Path, default=None,
                        help="The floor's audit database goes here [default: a temporary "
                             "directory].")
    parser.add_argument("--redis-url", default="",
                        help="The floor's run log (e.g. redis://127.0.0.1:6379/0) "
                             "[default: none].")
    parser.add_argument("--floor-without", action="append", default=[], choices=FLOOR_LAYERS,
                        metavar="LAYER",
                        help="With --floor: skip this layer's I/O (one of "
                             f"{', '.join(FLOOR_LAYERS)}; repeatable).")
    args = parser.parse_args(argv)
    if args.floor_without and not args.floor:
        parser.error("--floor-without is only meaningful with --floor")
    without = frozenset(args.floor_without)
    if not args.floor:
        asyncio.run(serve(args.host, args.port))
    elif args.state_dir is not None:
        args.state_dir.mkdir(parents=True, exist_ok=True)
        asyncio.run(serve(args.host, args.port, args.state_dir, args.redis_url, without))
    else:
        with tempfile.TemporaryDirectory(prefix="bench-floor-") as tmp:
            asyncio.run(serve(args.host, args.port, Path(tmp), args.redis_url, without))
    sys.exit(0)


if __name__ == "__main__":
    main()
