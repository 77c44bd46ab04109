"""Both audit stores (SQLite file, real PostgreSQL): numbering, chaining, querying, and
several writers sharing one trail."""

from __future__ import annotations

import asyncio

from stargrpc.audit.chain import verify
from stargrpc.audit.record import GENESIS_HASH, record_of, storable
from stargrpc.audit.store import AuditStore, Query, open_store
from tests.audit.records import make_record


async def test_append_numbers_and_chains_records(store: AuditStore) -> None:
    first = await store.append([make_record(), make_record()])
    second = await store.append([make_record(privileged=True, acting_for="bob")])

    stored = [r async for r in store.scan()]
    assert [r.seq for r in stored] == [1, 2, 3]
    assert stored[0].prev_hash == GENESIS_HASH
    assert stored[1].prev_hash == stored[0].hash
    assert stored[2].prev_hash == stored[1].hash
    assert stored == [*first, *second]  # read back exactly as written, types included
    assert stored[2].privileged is True and stored[2].who == "alice acting for bob"
    assert (await verify(store.scan())).intact


async def test_query_filters(store: AuditStore) -> None:
    await store.append([
        make_record(tool="echo", principal="alice", outcome="ok",
                    time="2026-01-01T00:00:00.000000Z"),
        make_record(tool="sleep", principal="bob", outcome="timeout",
                    time="2026-01-02T00:00:00.000000Z"),
        make_record(tool="echo", principal="svc", acting_for="alice", outcome="denied",
                    time="2026-01-03T00:00:00.000000Z"),
    ])

    def seqs(records: list) -> list[int]:
        return [r.seq for r in records]

    assert seqs(await store.query(Query(tool="echo"))) == [1, 3]
    assert seqs(await store.query(Query(principal="alice"))) == [1, 3]  # acting for, too
    assert seqs(await store.query(Query(outcome="timeout"))) == [2]
    assert seqs(await store.query(Query(since="2026-01-02T00:00:00.000000Z"))) == [2, 3]
    assert seqs(await store.query(Query(limit=2, newest_first=True))) == [3, 2]
    assert seqs(await store.query(Query(tool="echo", outcome="ok"))) == [1]
    await store.append([make_record(method="/grpc.health.v1.Health/Check", tool="")])
    assert seqs(await store.query(Query(method="Check"))) == [4]
    assert seqs(await store.query(Query(method="/grpc.health.v1.Health/Check"))) == [4]
    assert len(await store.query(Query(method="Execute"))) == 3


async def test_writers_sharing_a_store_build_one_chain(store_url: str) -> None:
    # Two replicas (two connections) appending at the same time.
    replicas = [open_store(store_url), open_store(store_url)]
    await asyncio.gather(*(replica.open() for replica in replicas))
    try:
        async def write(replica: AuditStore) -> None:
            for _ in range(15):
                await replica.append([make_record(), make_record()])

        await asyncio.gather(*(write(replica) for replica in replicas))
        records = [r async for r in replicas[0].scan(batch=7)]
        report = await verify(replicas[0].scan())
    finally:
        await asyncio.gather(*(replica.aclose() for replica in replicas))

    assert [r.seq for r in records] == list(range(1, 61))
    assert report.intact and report.checked == 60


async def test_a_writer_whose_head_moved_chains_after_the_other_writer(store_url: str) -> None:
    # Each store remembers the head it last wrote; when another replica appended since,
    # the next append must chain after that replica's records, not after its own.
    first, second = open_store(store_url), open_store(store_url)
    await first.open()
    await second.open()
    try:
        await first.append([make_record()])
        await second.append([make_record(), make_record()])
        [last] = await first.append([make_record()])
        await second.append([make_record()])
        records = [r async for r in first.scan()]
        report = await verify(first.scan())
    finally:
        await first.aclose()
        await second.aclose()

    assert last.seq == 4 and last.prev_hash == records[2].hash
    assert [r.seq for r in records] == [1, 2, 3, 4, 5]
    assert report.intact and report.checked == 5


async def test_a_lone_surrogate_or_a_nul_is_stored_as_its_escape(store: AuditStore) -> None:
    # A string with no UTF-8 form (a name read with surrogateescape, a decoded "\ud800"),
    # or with a NUL (PostgreSQL's text takes none), would make the store refuse the batch,
    # and the writer retry it forever: the writer hands the store records whose texts have
    # the escape written out, however they were made.
    made = make_record(detail="bad \udcff name", result="nul \x00 here")
    fast = record_of({**make_record().as_dict(), "result": "x\ud800y"})
    plain = make_record(result="héllo")
    assert storable(plain) is plain
    stored = await store.append([storable(made), storable(fast)])

    assert (stored[0].detail, stored[0].result) == ("bad \\udcff name", "nul \\x00 here")
    assert stored[1].result == "x\\ud800y"
    report = await verify(store.scan())
    assert report.intact, report


async def test_a_record_stored_with_a_nul_before_still_verifies(sqlite_url: str) -> None:
    # SQLite took a NUL in a text before texts were escaped: read back, such a record keeps
    # the text it was hashed over, and the trail still verifies.
    store = open_store(sqlite_url)
    await store.open()
    try:
        await store.append([make_record(result="old \x00 text"), make_record()])
        records = [r async for r in store.scan()]
        report = await verify(store.scan())
    finally:
        await store.aclose()

    assert records[0].result == "old \x00 text"
    assert report.intact, report
