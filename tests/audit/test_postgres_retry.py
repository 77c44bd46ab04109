"""A batch whose commit the PostgreSQL store could not confirm (the link broke after the
server committed the INSERT, before its reply arrived) and that is appended again: the
retry finds its records in the trail and returns them as stored — one copy each, the chain
intact — instead of failing on their ids forever while the audit queue waits behind it.
And a link that goes silent instead of breaking (a half-open connection, a stalled server):
the append gives its connection up after the store's write timeout and the writer goes on
on a new one, instead of waiting until TCP gives up — and the server ends the session left
behind, so a lock it held does not hold every other writer."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from pathlib import Path

import asyncpg
import grpc
import pytest
from structlog.testing import capture_logs

from stargrpc.audit.chain import verify
from stargrpc.audit.key import ChainKey, load_key
from stargrpc.audit.postgres import PostgresAuditStore
from stargrpc.audit.record import GENESIS_HASH, AuditRecord
from stargrpc.audit.writer import AuditWriter
from stargrpc.v1 import tool_service_pb2_grpc
from tests.audit.helpers import PG_BASE
from tests.audit.records import make_record
from tests.conftest import ServerFactory
from tests.helpers import eventually, run_tool

_PG_ADDRESS = PG_BASE.split("@", 1)[1].split("/", 1)[0]  # 127.0.0.1:5432


class _Link:
    """A TCP proxy in front of the PostgreSQL server that can drop the server's replies
    (:attr:`holding`) and then break every connection it carries (:meth:`cut`): an
    ambiguous commit, made to order. Or silence the connections it carries now, both ways,
    without ever closing them (:meth:`stall`): a half-open link — neither end hears of the
    other closing it either."""

    def __init__(self) -> None:
        self.port = 0
        self.holding = False
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self._silenced: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def url(self, url: str) -> str:
        """``url`` (of the real server) through this proxy."""
        return url.replace(_PG_ADDRESS, f"127.0.0.1:{self.port}")

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, port = _PG_ADDRESS.split(":")
        up_reader, up_writer = await asyncio.open_connection(host, int(port))
        self._writers += [writer, up_writer]
        for task in (asyncio.create_task(self._pump(reader, up_writer, replies=False)),
                     asyncio.create_task(self._pump(up_reader, writer, replies=True))):
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                    replies: bool) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(65536):
                if (replies and self.holding) or writer in self._silenced:
                    continue  # lost on the way
                writer.write(data)
                await writer.drain()
        if writer not in self._silenced:  # a silenced one is not told (until close())
            writer.transport.abort()

    def stall(self) -> None:
        """Silences every connection carried now, both ways, for good (they stay open);
        new connections work, with their replies."""
        self._silenced.update(self._writers)
        self.holding = False

    def cut(self) -> None:
        """Breaks every connection now, both ways; new ones get their replies again."""
        for writer in self._writers:
            writer.transport.abort()
        self._writers.clear()
        self.holding = False

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def _holds(watcher: asyncpg.Connection, count_sql: str, count: int) -> bool:
    """Whether the server holds ``count`` rows by ``count_sql``: the INSERT reached it and
    committed, whether or not its reply gets back."""
    return await watcher.fetchval(count_sql) >= count


async def _trail(url: str, key: ChainKey | None = None) -> list[AuditRecord]:
    """Every record of the trail at ``url``, after checking its chain."""
    store = PostgresAuditStore(url, key)
    await store.open()
    try:
        records = [r async for r in store.scan()]
        report = await verify(store.scan(), [key] if key else ())
    finally:
        await store.aclose()
    assert report.intact, report
    return records


async def test_a_batch_appended_again_after_it_landed_is_returned_as_stored(
        pg_url: str) -> None:
    store = PostgresAuditStore(pg_url)
    await store.open()
    try:
        [first] = await store.append([make_record()])
        batch = [make_record(), make_record()]
        landed = await store.append(batch)
        # The reply to that INSERT never came: the store still believes its head is the
        # record before the batch, and the writer appends the same records again.
        store._head = (first.seq, first.hash)
        again = await store.append(batch)
        after = await store.append([make_record()])  # and the trail goes on after them
    finally:
        await store.aclose()

    assert again == landed
    records = await _trail(pg_url)
    assert [r.seq for r in records] == [1, 2, 3, 4]
    assert [r.id for r in records].count(batch[0].id) == 1
    assert records[1:3] == landed and records[3] == after[0]
    assert after[0].prev_hash == landed[-1].hash


async def test_a_retry_that_finds_its_batch_from_a_store_that_never_saw_a_head(
        pg_url: str) -> None:
    # Another store object (the locked path from the start: no head in memory) appends
    # records already in the trail, followed by records of other writers.
    batch = [make_record(), make_record(), make_record()]
    store = PostgresAuditStore(pg_url)
    await store.open()
    try:
        landed = await store.append(batch)
        later = await store.append([make_record()])
        retry = PostgresAuditStore(pg_url)
        await retry.open()
        try:
            again = await retry.append(batch)
            [next_one] = await retry.append([make_record()])
        finally:
            await retry.aclose()
    finally:
        await store.aclose()

    assert again == landed
    records = await _trail(pg_url)
    assert len(records) == 5 and len({r.id for r in records}) == 5
    assert next_one.seq == 5 and next_one.prev_hash == later[0].hash


async def test_the_writer_drains_after_retrying_a_batch_that_landed(pg_url: str) -> None:
    store = PostgresAuditStore(pg_url)
    writer = AuditWriter(store)
    await writer.start()
    try:
        await writer.submit(make_record())
        batch = [make_record(), make_record()]
        landed = await store.append(batch)
        store._head = (0, GENESIS_HASH)  # as stale as it gets
        futures = [writer.submit(record) for record in batch]
        behind = writer.submit(make_record())
        stored = await asyncio.wait_for(asyncio.gather(*futures, behind), 10)
    finally:
        await writer.aclose()

    assert stored[:2] == landed and stored[2].seq == 4
    records = await _trail(pg_url)
    assert [r.seq for r in records] == [1, 2, 3, 4]


async def test_a_batch_found_in_part_is_completed_and_logged(pg_url: str) -> None:
    # Not something one INSERT can leave: some records of the batch are in the trail, one
    # of them under its id with other content. What is missing is appended, what is there
    # is returned as stored, and the operator hears of it.
    store = PostgresAuditStore(pg_url)
    await store.open()
    try:
        first, second, third = make_record(), make_record(), make_record()
        landed = await store.append([first, second])
        store._head = None
        changed = dataclasses.replace(second, result="something else")
        with capture_logs() as logs:
            stored = await store.append([first, changed, third])
    finally:
        await store.aclose()

    assert stored[:2] == landed and stored[2].seq == 3
    assert [r.id for r in await _trail(pg_url)] == [first.id, second.id, third.id]
    [error] = [entry for entry in logs if entry["event"] == "audit_batch_partly_in_trail"]
    assert error["log_level"] == "error" and error["found"] == 2
    assert error["other_content_ids"] == [second.id]
    # The record not stored (its id holds other content) is in the error, whole.
    assert error["not_stored"] == [changed.as_dict()]
    assert error["not_stored"][0]["result"] == "something else"


async def test_a_commit_whose_reply_was_lost_is_not_written_twice(pg_url: str) -> None:
    # A real broken link: the INSERT reaches the server and commits, its reply is dropped,
    # then the connection breaks. The writer retries, finds the batch, and drains.
    link = _Link()
    await link.start()
    store = PostgresAuditStore(link.url(pg_url))
    writer = AuditWriter(store)
    watcher = await asyncpg.connect(pg_url)
    try:
        await writer.start()
        await writer.submit(make_record())  # the store knows its head: the fast path next
        link.holding = True
        batch = [make_record(), make_record()]
        futures = [writer.submit(record) for record in batch]
        await eventually(lambda: _holds(watcher, "SELECT count(*) FROM audit_records", 3),
                         within=10, what="the records reached the server")
        await asyncio.sleep(0.05)
        assert not any(future.done() for future in futures)  # its commit is unknown
        link.cut()
        behind = writer.submit(make_record())
        stored = await asyncio.wait_for(asyncio.gather(*futures, behind), 20)
        assert writer.pending == 0
    finally:
        await watcher.close()
        await writer.aclose()
        await link.close()

    records = await _trail(pg_url)
    assert [r.seq for r in records] == [1, 2, 3, 4]
    assert records[1:] == stored
    assert [r.id for r in stored] == [*(r.id for r in batch), stored[2].id]


async def test_the_server_keeps_serving_after_a_commit_whose_reply_was_lost(
        make_server: ServerFactory, pg_url: str, tmp_path: Path) -> None:
    link = _Link()
    await link.start()
    watcher = await asyncpg.connect(pg_url)
    server = await make_server(audit_store=link.url(pg_url), audit_commit_timeout_seconds=10.0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = tool_service_pb2_grpc.ToolServiceStub(channel)
            before = await run_tool(stub, "echo", {"text": "before"})
            link.holding = True
            call = asyncio.create_task(run_tool(stub, "echo", {"text": "during"}))
            await eventually(lambda: _holds(
                watcher, "SELECT count(*) FROM audit_records WHERE tool = 'echo'", 2),
                within=10, what="the records reached the server")
            assert not call.done()  # its Result waits for a commit the server cannot confirm
            link.cut()
            during = await asyncio.wait_for(call, 20)
            after = await asyncio.wait_for(run_tool(stub, "echo", {"text": "after"}), 20)
        await server.stop(grace=10)
    finally:
        await watcher.close()
        await link.close()

    assert [events[-1].result.output for events in (before, during, after)] == [
        "before", "during", "after"]
    key = load_key(Path(server.settings.state_dir) / "audit-hmac.key")
    records = await _trail(pg_url, key)
    assert [r.run_id for r in records if r.tool == "echo"] == [
        events[-1].run_id for events in (before, during, after)]
    assert len({r.id for r in records}) == len(records)


async def test_an_append_on_a_link_gone_silent_is_given_up_and_made_again(pg_url: str) -> None:
    link = _Link()
    await link.start()
    store = PostgresAuditStore(link.url(pg_url), write_timeout=0.5)
    writer = AuditWriter(store)
    try:
        await writer.start()
        first = await writer.submit(make_record())
        link.stall()  # the append connection goes quiet: no reset, no reply, ever
        with capture_logs() as logs:
            second = await asyncio.wait_for(writer.submit(make_record()), 20)
            third = await asyncio.wait_for(writer.submit(make_record()), 20)
        assert writer.pending == 0
    finally:
        await asyncio.wait_for(writer.aclose(), 20)  # closing is not held by the dead link
        await link.close()

    assert [r.seq for r in (first, second, third)] == [1, 2, 3]
    assert [r.id for r in await _trail(pg_url)] == [first.id, second.id, third.id]
    failures = [entry for entry in logs if entry["event"] == "audit_write_failed"]
    assert failures and "did not answer within 0.5 s" in failures[0]["error"]


async def test_a_commit_unanswered_on_a_silent_link_is_recognised_on_the_new_one(
        pg_url: str) -> None:
    # The INSERT commits, its reply is lost, and the link then goes quiet instead of
    # breaking: the timeout gives the connection up, and the retry finds the batch.
    link = _Link()
    await link.start()
    store = PostgresAuditStore(link.url(pg_url), write_timeout=1.0)
    writer = AuditWriter(store)
    watcher = await asyncpg.connect(pg_url)
    try:
        await writer.start()
        await writer.submit(make_record())
        link.holding = True
        batch = [make_record(), make_record()]
        futures = [writer.submit(record) for record in batch]
        await eventually(lambda: _holds(watcher, "SELECT count(*) FROM audit_records", 3),
                         within=10, what="the records reached the server")
        link.stall()
        stored = await asyncio.wait_for(asyncio.gather(*futures), 20)
    finally:
        await watcher.close()
        await asyncio.wait_for(writer.aclose(), 20)
        await link.close()

    records = await _trail(pg_url)
    assert [r.seq for r in records] == [1, 2, 3]
    assert records[1:] == stored


_ADVISORY_LOCKS = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted = $1"


async def test_the_append_connection_asks_the_server_to_end_what_it_leaves(
        pg_url: str) -> None:
    # The server ends a session of the append connection left in its transaction after the
    # write timeout, and a lock wait fails a little before it; the URL's own settings (the
    # schema) apply too, and a setting the URL makes itself has its way.
    store = PostgresAuditStore(pg_url, write_timeout=1.5)
    await store.open()
    own = PostgresAuditStore(f"{pg_url}&lock_timeout=4000", write_timeout=1.5)
    try:
        await store.append([make_record()])
        await own.append([make_record()])
        settings = "SELECT current_setting($1)"
        assert store._writer is not None and own._writer is not None
        schema = pg_url.rsplit("search_path=", 1)[1]
        for conn, lock_timeout in ((store._writer, "1350ms"), (own._writer, "4s")):
            assert await conn.fetchval(settings, "search_path") == schema
            assert await conn.fetchval(
                settings, "idle_in_transaction_session_timeout") == "1500ms"
            assert await conn.fetchval(settings, "lock_timeout") == lock_timeout
    finally:
        await own.aclose()
        if own._writer is not None:  # never opened: aclose() leaves its connection
            await own._writer.close()
        await store.aclose()
    assert [r.seq for r in await _trail(pg_url)] == [1, 2]


async def test_a_lock_held_by_a_session_on_a_silent_link_is_let_go_by_the_server(
        pg_url: str) -> None:
    # A store's link goes silent inside the locked path's transaction, after the server
    # gave it the writers' lock. Its append is given up, but closing its end tells the
    # server nothing: the session stays idle in its transaction, holding the lock, until
    # the server ends it — soon, not when TCP notices — and the other writers go on.
    link = _Link()
    await link.start()
    other = PostgresAuditStore(pg_url, write_timeout=10.0)  # a replica on a sound link
    await other.open()
    stalled = PostgresAuditStore(link.url(pg_url), write_timeout=1.0)  # the locked path
    holder = await asyncpg.connect(pg_url)
    try:
        holding = holder.transaction()
        await holding.start()
        await holder.execute(
            "SELECT pg_advisory_xact_lock(hashtext(current_schema() || '.audit_records'))")
        record = make_record()
        append = asyncio.create_task(stalled.append([record]))

        async def waits_for_the_lock() -> bool:
            assert not append.done()
            return bool(await holder.fetchval(_ADVISORY_LOCKS, False))

        await eventually(waits_for_the_lock, within=10, interval=0.005,
                         what="the append waiting for the lock")
        link.stall()
        await holding.commit()  # the server gives it the lock; the reply is lost
        await eventually(lambda: holder.fetchval(_ADVISORY_LOCKS, True), within=10,
                         interval=0.005, what="the append holding the lock")

        started = time.monotonic()
        [theirs] = await asyncio.wait_for(other.append([make_record()]), 15)
        waited = time.monotonic() - started
        with pytest.raises(TimeoutError, match="did not answer within 1 s"):
            await append
        [ours] = await asyncio.wait_for(stalled.append([record]), 10)  # on a new connection
    finally:
        await holder.close()
        if stalled._writer is not None:
            stalled._writer.terminate()
        await other.aclose()
        await link.close()

    assert waited < 3, f"the other writer waited {waited:.1f} s for the lock"
    assert (theirs.seq, ours.seq) == (1, 2)
    assert [r.id for r in await _trail(pg_url)] == [theirs.id, record.id]


async def test_connecting_counts_against_the_write_timeout(pg_url: str) -> None:
    # A server that takes the connection and never answers: the append fails after the
    # write timeout, with the store's own message, like an append that gets no answer.
    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the store gives up and closes
        writer.close()

    silent = await asyncio.start_server(swallow, "127.0.0.1", 0)
    port = silent.sockets[0].getsockname()[1]
    store = PostgresAuditStore(pg_url.replace(_PG_ADDRESS, f"127.0.0.1:{port}"),
                               write_timeout=0.5)
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=r"did not answer within 0\.5 s"):
            await asyncio.wait_for(store.append([make_record()]), 10)
        assert time.monotonic() - started < 2
    finally:
        silent.close()
        await silent.wait_closed()
