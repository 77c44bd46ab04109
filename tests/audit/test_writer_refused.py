"""A record the audit store refuses for its content does not stop the trail: its batch is
split, the record is replaced by a substitute that says it was refused and why (the chain
intact, the record whole in the error log, a counter), and every other record — before it,
after it, submitted later — is stored as it is. Real SQLite and PostgreSQL stores, each with
a record it really refuses; a store that refuses everything is retried, not substituted."""

from __future__ import annotations

import asyncio
import secrets
import sqlite3
from collections.abc import Sequence

from structlog.testing import capture_logs

from stargrpc import metrics
from stargrpc.audit.chain import verify
from stargrpc.audit.record import AuditRecord
from stargrpc.audit.sqlite import SqliteAuditStore
from stargrpc.audit.store import open_store
from stargrpc.audit.writer import AuditWriter
from tests.audit.records import make_record

WAIT = 60.0  # a bound on waits, never a claim about speed


def _refused_count() -> float:
    return metrics.REGISTRY.get_sample_value("stargrpc_audit_records_refused_total") or 0.0


async def _write_with_one_refused(url: str, refused: AuditRecord
                                  ) -> tuple[list[AuditRecord], list[AuditRecord], list[dict]]:
    """Five records in one batch, the third ``refused``, then one more on its own: what
    their futures gave, what the trail holds, and the log lines."""
    records = [make_record(), make_record(), refused, make_record(), make_record()]
    writer = AuditWriter(open_store(url))
    await writer.start()
    with capture_logs() as logs:
        futures = [writer.submit(record) for record in records]
        given = [await asyncio.wait_for(future, WAIT) for future in futures]
        given.append(await asyncio.wait_for(writer.submit(make_record()), WAIT))
    await writer.aclose()
    reopened = open_store(url)
    await reopened.open()
    try:
        trail = [record async for record in reopened.scan()]
        assert (await verify(reopened.scan())).intact  # stargrpc audit verify passes
    finally:
        await reopened.aclose()
    return given, trail, logs


def _check(records_in: AuditRecord, given: list[AuditRecord], trail: list[AuditRecord],
           logs: list[dict], said: str) -> None:
    assert [record.seq for record in trail] == [1, 2, 3, 4, 5, 6]
    assert [record.id for record in trail] == [record.id for record in given]
    substitute = trail[2]
    assert substitute.id == records_in.id  # found under the call's own record id
    assert "refused" in substitute.detail and said in substitute.detail
    assert substitute.arguments == "" and substitute.result == ""
    assert given[2] == substitute  # the caller awaiting it learns what stands in its place
    for stored in trail[:2] + trail[3:]:  # every other record as it was written
        assert "refused" not in stored.detail and stored.arguments == '{"text":"hi"}'
    lines = [line for line in logs if line["event"] == "audit_record_refused"]
    assert len(lines) == 1
    assert lines[0]["record"]["id"] == records_in.id
    assert lines[0]["record"]["principal"] == records_in.principal  # whole, in the log
    assert lines[0]["substitute_seq"] == 3


async def test_a_record_sqlite_refuses_is_replaced_and_the_trail_goes_on(
        sqlite_url: str) -> None:
    # SQLite stores a NaN as NULL, which the NOT NULL duration column refuses, every time.
    refused = make_record(duration_ms=float("nan"))
    before = _refused_count()

    given, trail, logs = await _write_with_one_refused(sqlite_url, refused)

    _check(refused, given, trail, logs, "NOT NULL constraint failed")
    assert trail[2].duration_ms == 0.0
    assert _refused_count() == before + 1


async def test_a_record_postgresql_refuses_is_replaced_and_the_trail_goes_on(
        pg_url: str) -> None:
    # An indexed text over a third of a page (random, so it does not compress): PostgreSQL
    # refuses it (index row size … exceeds btree version 4 maximum 2704), every time.
    refused = make_record(principal=secrets.token_urlsafe(6000))
    before = _refused_count()

    given, trail, logs = await _write_with_one_refused(pg_url, refused)

    _check(refused, given, trail, logs, "exceeds btree")
    assert trail[2].principal == refused.principal[:200]
    assert _refused_count() == before + 1


class RefusingEverything(SqliteAuditStore):
    """A real SQLite store whose first appends all fail with an error that reads as a
    refusal (as a broken file may): the store is at fault, not any record."""

    failures: int

    async def append(self, records: Sequence[AuditRecord]) -> list[AuditRecord]:
        if self.failures:
            self.failures -= 1
            raise sqlite3.IntegrityError("refused whatever it is given")
        return await super().append(records)


async def test_a_store_that_refuses_even_the_substitute_is_retried_and_loses_nothing(
        sqlite_url: str) -> None:
    store = RefusingEverything(sqlite_url, on_loop=False)
    store.failures = 6  # the batch, its halves, a record alone, its substitute, …
    writer = AuditWriter(store)
    await writer.start()
    records = [make_record() for _ in range(3)]
    with capture_logs() as logs:
        stored = [await asyncio.wait_for(writer.submit(record), WAIT) for record in records]
    await writer.aclose()

    assert [record.id for record in stored] == [record.id for record in records]
    assert all("refused" not in record.detail for record in stored)
    assert store.failures == 0
    assert not [line for line in logs if line["event"] == "audit_record_refused"]
    assert [line for line in logs if line["event"] == "audit_substitute_refused"]
