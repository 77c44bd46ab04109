"""Tamper evidence: a changed, deleted or reordered record breaks the chain at that record."""

from __future__ import annotations

import dataclasses

from stargrpc.audit.chain import record_hash, seal, verify
from stargrpc.audit.record import GENESIS_HASH
from stargrpc.audit.store import AuditStore, Query
from tests.audit.helpers import execute_raw
from tests.audit.records import make_record


async def _five(store: AuditStore) -> None:
    await store.append([make_record(tool=f"t{i}") for i in range(5)])


async def test_an_intact_trail_verifies(store: AuditStore) -> None:
    await _five(store)

    report = await verify(store.scan())

    assert report.intact
    assert report.checked == 5
    newest = await store.query(Query(limit=1, newest_first=True))
    assert report.head_hash == newest[0].hash


async def test_a_changed_record_is_named(store: AuditStore, store_url: str) -> None:
    await _five(store)
    await execute_raw(store_url, "UPDATE audit_records SET outcome = 'ok', principal = 'eve' "
                      "WHERE seq = 3")

    report = await verify(store.scan())

    assert not report.intact
    assert report.bad_seq == 3
    assert "changed" in report.reason
    assert report.checked == 2


async def test_a_deleted_record_is_named(store: AuditStore, store_url: str) -> None:
    await _five(store)
    await execute_raw(store_url, "DELETE FROM audit_records WHERE seq = 2")

    report = await verify(store.scan())

    assert report.bad_seq == 3
    assert "missing" in report.reason


async def test_deleting_the_first_record_is_noticed(store: AuditStore, store_url: str) -> None:
    await _five(store)
    await execute_raw(store_url, "DELETE FROM audit_records WHERE seq = 1")

    assert (await verify(store.scan())).bad_seq == 2


async def test_reordered_records_are_named(store: AuditStore, store_url: str) -> None:
    await _five(store)
    # Swap the places of records 2 and 4 (seq is the order).
    await execute_raw(store_url,
                      "UPDATE audit_records SET seq = 100 WHERE seq = 2",
                      "UPDATE audit_records SET seq = 2 WHERE seq = 4",
                      "UPDATE audit_records SET seq = 4 WHERE seq = 100")

    report = await verify(store.scan())

    assert report.bad_seq == 2
    assert "prev_hash" in report.reason


async def test_a_rehashed_forgery_still_breaks_the_next_link() -> None:
    # A forger who recomputes the changed record's own hash breaks the link after it.
    records = seal([make_record(), make_record(), make_record()], 0, GENESIS_HASH)
    forged = dataclasses.replace(records[1], principal="eve")
    forged = dataclasses.replace(forged, hash=record_hash(forged))

    async def scan():  # type: ignore[no-untyped-def]
        for record in (records[0], forged, records[2]):
            yield record

    report = await verify(scan())

    assert report.bad_seq == 3


def test_emptying_a_field_changes_the_hash() -> None:
    [record] = seal([make_record(detail="refused")], 0, GENESIS_HASH)

    assert record_hash(dataclasses.replace(record, detail="")) != record.hash
    assert record_hash(record) == record.hash
