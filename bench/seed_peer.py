"""The seed 000/001 design as a peer: tool calls over Redis streams, no gRPC.

The design stargrpc was drawn from (``/work/shared/seeds``, documents 000 and 001), written
here as leanly as ``redis.asyncio`` with hiredis allows, so the benchmark compares stargrpc
with the best version of it rather than a straw man:

- **the caller** ``XADD``s a request (tool, arguments, a correlation id, its reply stream, an
  idempotency key) to the request stream and awaits its reply, which one reader task per
  caller takes off the caller's own reply stream with ``XREAD BLOCK`` and hands to the call
  waiting on that correlation id;
- **the worker** (its own process, ``python -m bench.seed_peer``) ``XREADGROUP``s requests in
  batches, claims each idempotency key (``SET NX EX``: a request redelivered while it runs,
  or after, is not run twice — a finished one is answered from the cached result), runs the
  tool in a task of its own, caches the result (``SET EX``), ``XADD``s the reply to the
  caller's reply stream and ``XACK``s the request.

Every write goes through one :class:`Pipe` per process: the commands queued in one turn of
the event loop are packed by hiredis and sent in one round trip on a connection of its own
(the claims of one read batch share a round trip; so do the result, reply and ack of one
call, and those of every call ending in the same turn). Blocking reads have connections of
their own. Streams are trimmed (``MAXLEN ~``) as a deployment would.

Every key lives under the prefix given (``bench:seed:<id>:``); the worker deletes them all
when it stops (results and claims also expire on their own).

Run the worker: ``python -m bench.seed_peer --redis-url redis://127.0.0.1:6379/0 --prefix
bench:seed:ID:``; it prints ``{"event": "serving", "address": "seed:URL#PREFIX"}`` once its
consumer group exists. The benchmark client (``bench/client.py``) drives it through
:class:`SeedCaller`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import signal
import sys
import uuid
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import hiredis
import redis.asyncio

#: Consumer group of the workers on the request stream.
GROUP = "workers"
#: How long a claim and a cached result live (seconds), as in the seed design.
CLAIM_SECONDS = 300
RESULT_SECONDS = 120
#: Approximate length streams are trimmed to.
MAXLEN = 10_000
#: Most requests one XREADGROUP takes.
READ_BATCH = 256

Command = Sequence[str | bytes | int | float]


def parse_address(address: str) -> tuple[str, str]:
    """``seed:URL#PREFIX`` → (URL, PREFIX); only Redis on 127.0.0.1 is accepted."""
    if not address.startswith("seed:") or "#" not in address:
        raise ValueError(f"not a seed peer address: {address!r}")
    url, prefix = address[len("seed:"):].split("#", 1)
    if urlsplit(url).hostname not in ("127.0.0.1", "localhost"):
        raise ValueError("the benchmark only talks to 127.0.0.1")
    return url, prefix


#: Errors after which a connection is made again (someone may kill clients on a shared
#: Redis: ``CLIENT KILL``).
_LOST = (redis.ConnectionError, redis.TimeoutError, OSError)


class Pipe:
    """Commands to Redis, every command queued in one turn of the loop sent in one round
    trip on a connection of its own (packed by hiredis, no pool lookup, lock or socket
    timeout task per command). A batch whose connection was lost is sent once more on a
    new one (the callers' commands are written to be safe to repeat)."""

    def __init__(self, client: redis.asyncio.Redis) -> None:
        self._client = client
        self._queue: list[tuple[Sequence[Command], asyncio.Future[list[Any]]]] = []
        self._wanted = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._write())

    def send(self, *commands: Command) -> asyncio.Future[list[Any]]:
        """Queues commands to go out together; the future holds their replies in order
        (an error reply as a ``redis.ResponseError`` in its place)."""
        future: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        self._queue.append((commands, future))
        self._wanted.set()
        return future

    async def _write(self) -> None:
        conn = await self._client.connection_pool.get_connection()
        try:
            while True:
                await self._wanted.wait()
                self._wanted.clear()
                batch, self._queue = self._queue, []
                for attempt in range(2):
                    try:
                        await self._round_trip(conn, batch)
                        break
                    except _LOST as exc:
                        await conn.disconnect(nowait=True)  # reconnects on the next send
                        if attempt == 1:
                            for _, future in batch:
                                if not future.done():
                                    future.set_exception(exc)
        finally:
            await self._client.connection_pool.release(conn)

    async def _round_trip(self, conn: Any,
                          batch: list[tuple[Sequence[Command], asyncio.Future[list[Any]]]]
                          ) -> None:
        await conn.send_packed_command(
            [hiredis.pack_command(tuple(c)) for cs, _ in batch for c in cs], check_health=False)
        replies = [[await self._read(conn) for _ in commands] for commands, _ in batch]
        for (_, future), found in zip(batch, replies, strict=True):
            if not future.done():
                future.set_result(found)

    @staticmethod
    async def _read(conn: Any) -> Any:
        try:
            return await conn.read_response()
        except redis.ResponseError as exc:  # the reply was read whole: the rest follow
            return exc

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


def _fields(entry: Any) -> dict[bytes, bytes]:
    """A stream entry's fields, whether redis-py gave them as a dict or a flat list."""
    if isinstance(entry, dict):
        return entry
    return dict(zip(entry[::2], entry[1::2], strict=True))


# -- the caller ----------------------------------------------------------------------------

class SeedCaller:
    """The caller side: requests out on the request stream, replies in on a stream of its
    own read by one ``XREAD BLOCK`` task."""

    def __init__(self, url: str, prefix: str) -> None:
        self._url = url
        self._requests = f"{prefix}requests"
        self._replies = f"{prefix}reply:{uuid.uuid4().hex}"
        self._waiting: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._client = redis.asyncio.Redis.from_url(url, socket_timeout=None,
                                                    client_name="bench-seed-caller")
        self._reader_client = redis.asyncio.Redis.from_url(
            url, socket_timeout=None, single_connection_client=True,
            client_name="bench-seed-caller")
        self._pipe = Pipe(self._client)
        self._reader = asyncio.get_running_loop().create_task(self._read_replies())
        self._reader.add_done_callback(self._reader_ended)

    def _reader_ended(self, reader: asyncio.Task[None]) -> None:
        # Nothing would answer the calls waiting: they fail now, with the reader's error.
        error = (reader.exception() if not reader.cancelled() else None) or RuntimeError(
            "the reply reader stopped")
        for waiter in self._waiting.values():
            if not waiter.done():
                waiter.set_exception(error)

    async def call(self, tool: str, arguments: dict[str, Any] | None = None,
                   seconds: float = 60.0) -> dict[str, Any]:
        """Runs one tool call to its reply (``{"correlation_id", "result" | "error"}``)."""
        correlation = uuid.uuid4().hex
        reply: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[correlation] = reply
        request = json.dumps({"tool": tool, "arguments": arguments or {},
                              "correlation_id": correlation, "idem_key": correlation,
                              "reply_to": self._replies}, separators=(",", ":"))
        try:
            [sent] = await self._pipe.send(("XADD", self._requests, "MAXLEN", "~", MAXLEN, "*",
                                            "p", request))
            if isinstance(sent, Exception):
                raise sent
            if self._reader.done():
                self._reader_ended(self._reader)
            return await asyncio.wait_for(reply, seconds)
        finally:
            self._waiting.pop(correlation, None)

    async def _read_replies(self) -> None:
        last: str | bytes = "0-0"  # the stream is this caller's own, new: all of it replies
        while True:
            try:
                found = await self._reader_client.xread({self._replies: last}, count=512,
                                                        block=5000)
            except _LOST:  # read again from the last reply seen, on a new connection
                await asyncio.sleep(0.05)
                continue
            for _, entries in found or ():
                for entry_id, fields in entries:
                    last = entry_id
                    payload = json.loads(_fields(fields)[b"p"])
                    waiter = self._waiting.get(payload.get("correlation_id", ""))
                    if waiter is not None and not waiter.done():
                        waiter.set_result(payload)

    async def close(self) -> None:
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, redis.RedisError):
            await self._reader
        with contextlib.suppress(redis.RedisError):
            await self._pipe.send(("UNLINK", self._replies))
        await self._pipe.close()
        await self._reader_client.aclose()
        await self._client.aclose()


# -- the worker ----------------------------------------------------------------------------

async def _bench_trivial(arguments: dict[str, Any]) -> str:
    return ""


async def _bench_wait(arguments: dict[str, Any]) -> str:
    await asyncio.sleep(float(arguments.get("ms", 10.0)) / 1000)
    return ""


TOOLS = {"bench_trivial": _bench_trivial, "bench_wait": _bench_wait}


class SeedWorker:
    """The worker side: requests taken from the group in batches, each run in a task."""

    def __init__(self, url: str, prefix: str, name: str) -> None:
        self._prefix = prefix
        self._requests = f"{prefix}requests"
        self._name = name
        self._client = redis.asyncio.Redis.from_url(url, socket_timeout=None,
                                                    client_name="bench-seed-worker")
        self._reader_client = redis.asyncio.Redis.from_url(
            url, socket_timeout=None, single_connection_client=True,
            client_name="bench-seed-worker")
        self._pipe = Pipe(self._client)
        self._running: set[asyncio.Task[None]] = set()

    async def open(self) -> None:
        with contextlib.suppress(redis.ResponseError):  # BUSYGROUP: it exists already
            await self._client.xgroup_create(self._requests, GROUP, id="$", mkstream=True)

    async def serve(self, stop: asyncio.Event) -> None:
        """Takes requests until ``stop`` is set."""
        pending = False
        while not stop.is_set():
            try:
                await self._take(READ_BATCH, pending)
                pending = False
            except redis.RedisError as exc:  # say so, and read again
                print(json.dumps({"event": "redis_error", "error": f"{exc!r}: {exc}"}),
                      flush=True)
                # Requests delivered on a lost connection are this worker's, pending: take
                # them again first.
                pending = isinstance(exc, _LOST)
                await asyncio.sleep(0.05)

    async def _take(self, count: int, pending: bool = False) -> None:
        found = await self._reader_client.xreadgroup(
            GROUP, self._name, {self._requests: "0" if pending else ">"}, count=count,
            block=None if pending else 1000)
        batch = [(entry_id, json.loads(_fields(fields)[b"p"]))
                 for _, entries in found or () for entry_id, fields in entries]
        if not batch:
            return
        # Every claim of the batch in one round trip, each holding the id of the request it
        # was made for: the previous holder comes back (GET), so a claim sent again for the
        # same request (after a lost connection) is still its own, while another request
        # with the same idempotency key finds it taken.
        claims = await asyncio.gather(*(self._pipe.send(
            ("SET", f"{self._prefix}claim:{request['idem_key']}", entry_id, "NX", "GET",
             "EX", CLAIM_SECONDS)) for entry_id, request in batch))
        for (entry_id, request), [holder] in zip(batch, claims, strict=True):
            task = asyncio.create_task(
                self._handle(entry_id, request) if holder in (None, entry_id)
                else self._answer_again(entry_id, request))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _handle(self, entry_id: bytes, request: dict[str, Any]) -> None:
        correlation = request.get("correlation_id", "")
        tool = TOOLS.get(request.get("tool", ""))
        reply: dict[str, Any] = {"correlation_id": correlation}
        if tool is None:
            reply["error"] = f"unknown tool {request.get('tool')!r}"
        else:
            try:
                reply["result"] = await tool(request.get("arguments") or {})
            except Exception as exc:  # the seed's outcome: the caller gets a message
                reply["error"] = f"tool raised {type(exc).__name__}"
        encoded = json.dumps(reply, separators=(",", ":"))
        # Cache the result, send the reply and acknowledge the request: one round trip.
        await self._pipe.send(
            ("SET", f"{self._prefix}result:{request['idem_key']}", encoded, "EX",
             RESULT_SECONDS),
            ("XADD", request["reply_to"], "MAXLEN", "~", MAXLEN, "*", "p", encoded),
            ("XACK", self._requests, GROUP, entry_id))

    async def _answer_again(self, entry_id: bytes, request: dict[str, Any]) -> None:
        """A request whose key was claimed before: answered from the cached result, or left
        to the worker still running it."""
        [cached] = await self._pipe.send(
            ("GET", f"{self._prefix}result:{request['idem_key']}"))
        commands: list[Command] = [("XACK", self._requests, GROUP, entry_id)]
        if isinstance(cached, bytes):
            commands.append(("XADD", request["reply_to"], "MAXLEN", "~", MAXLEN, "*", "p",
                             cached))
        await self._pipe.send(*commands)

    async def close(self) -> None:
        """Waits for the calls under way (5 s at most), then deletes every key of the
        prefix."""
        if self._running:
            await asyncio.wait(self._running, timeout=5.0)
        await self._pipe.close()
        keys = [key async for key in self._client.scan_iter(match=f"{self._prefix}*",
                                                             count=1000)]
        for start in range(0, len(keys), 1000):
            await self._client.unlink(*keys[start:start + 1000])
        await self._reader_client.aclose()
        await self._client.aclose()


async def serve(url: str, prefix: str) -> None:
    """Runs a worker until SIGTERM or SIGINT."""
    worker = SeedWorker(url, prefix, f"worker-{uuid.uuid4().hex[:8]}")
    await worker.open()
    # The same collector settings as `stargrpc serve` and the bare baseline.
    gc.collect()
    gc.freeze()
    gc.set_threshold(5_000, 20, 20)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(json.dumps({"event": "serving", "address": f"seed:{url}#{prefix}"}), flush=True)
    serving = asyncio.create_task(worker.serve(stop))
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({serving, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if serving.done():
        stopped.cancel()
        await serving  # it only ends early on an error: raise it (the log shows it)
    # Bounded: a read blocks at most its 1 s, then sees stop.
    with contextlib.suppress(TimeoutError, redis.RedisError):
        await asyncio.wait_for(serving, 5.0)
    serving.cancel()
    with contextlib.suppress(asyncio.CancelledError, redis.RedisError):
        await serving
    await worker.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.seed_peer",
                                     description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--prefix", default="",
                        help="Key prefix [default: bench:seed:<random>:].")
    args = parser.parse_args(argv)
    prefix = args.prefix or f"bench:seed:{uuid.uuid4().hex[:12]}:"
    if not prefix.startswith("bench:seed:"):
        parser.error("the prefix must start with bench:seed:")
    parse_address(f"seed:{args.redis_url}#{prefix}")  # 127.0.0.1 only
    asyncio.run(serve(args.redis_url, prefix))
    sys.exit(0)


if __name__ == "__main__":
    main()
