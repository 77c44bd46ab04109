"""The audit record's ``usage`` (added after the first version): an older trail, without
the column, keeps verifying once this version opens it and goes on with receipts; an empty
usage leaves a record's canonical form — and so its hash — as it was before the field."""

from __future__ import annotations

import hashlib
import json

from stargrpc.audit.chain import record_hash, seal, verify
from stargrpc.audit.record import GENESIS_HASH, AuditRecord
from stargrpc.audit.store import TABLE, open_store
from stargrpc.cli.audit import format_record
from tests.audit.helpers import execute_raw
from tests.audit.records import make_record


async def _scan(url: str) -> list[AuditRecord]:
    store = open_store(url)
    await store.open()
    try:
        return [record async for record in store.scan()]
    finally:
        await store.aclose()


def test_a_record_without_usage_hashes_as_before_the_field() -> None:
    [record] = seal([make_record()], 0, GENESIS_HASH)
    before = {name: value for name, value in record.as_dict().items()
              if name not in ("hash", "usage") and value != ""}
    canonical = json.dumps(before, sort_keys=True, ensure_ascii=False, separators=(",", ":"))

    assert record.usage == ""
    assert record_hash(record) == hashlib.sha256(canonical.encode()).hexdigest()


async def test_a_trail_from_before_receipts_keeps_verifying_and_goes_on_with_them(
        store_url: str) -> None:
    old = open_store(store_url)
    await old.open()
    await old.append([make_record() for _ in range(3)])
    await old.aclose()
    # As a version before receipts left it: no usage column at all.
    await execute_raw(store_url, f"ALTER TABLE {TABLE} DROP COLUMN usage")

    store = open_store(store_url)  # this version: adds the column, empty in the old rows
    await store.open()
    try:
        await store.append([make_record(usage='{"wall_seconds":0.5,"child_runs":0}')
                            for _ in range(2)])
        report = await verify(store.scan())
    finally:
        await store.aclose()
    records = await _scan(store_url)

    assert report.intact and report.checked == 5
    assert [r.usage for r in records] == [""] * 3 + ['{"wall_seconds":0.5,"child_runs":0}'] * 2


async def test_changing_a_kept_receipt_breaks_the_chain(store_url: str) -> None:
    store = open_store(store_url)
    await store.open()
    await store.append([make_record(usage='{"wall_seconds":0.5}') for _ in range(2)])
    await store.aclose()
    await execute_raw(store_url, f"UPDATE {TABLE} SET usage = '{{\"wall_seconds\":0.1}}' "
                                 "WHERE seq = 1")

    store = open_store(store_url)
    await store.open()
    try:
        report = await verify(store.scan())
    finally:
        await store.aclose()

    assert not report.intact and report.bad_seq == 1


def test_stargrpc_audit_query_shows_the_receipt_on_the_record_s_line() -> None:
    line = format_record(make_record(usage='{"wall_seconds":0.5,"cpu_user_seconds":0.25}'))
    older = format_record(make_record())

    assert '1.5ms  usage={"wall_seconds":0.5,"cpu_user_seconds":0.25}  args=' in line
    assert "usage=" not in older
