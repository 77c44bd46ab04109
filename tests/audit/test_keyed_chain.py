"""The keyed chain and anchors, against each attacker the README names, on both stores:
someone who can write the database only; someone who also has the key file; someone who
cuts records off the end or deletes the whole trail; someone who rewrites history before an
anchor. And the trails written before keys: they keep verifying."""

from __future__ import annotations

import dataclasses
import os
import sqlite3
import stat
from pathlib import Path

import asyncpg
import pytest

from stargrpc.audit.chain import Anchor, seal, verify
from stargrpc.audit.key import AuditKeyError, ChainKey, load_key, load_or_create_key
from stargrpc.audit.record import FIELDS, GENESIS_HASH, AuditRecord
from stargrpc.audit.store import TABLE, AuditStore, open_store, sqlite_path
from tests.audit.helpers import execute_raw
from tests.audit.records import make_record

KEY = ChainKey.from_secret(b"k" * 32)
OTHER_KEY = ChainKey.from_secret(b"o" * 32)


async def _opened(url: str, key: ChainKey | None) -> AuditStore:
    store = open_store(url, key)
    await store.open()
    return store


async def _trail(url: str) -> list[AuditRecord]:
    store = await _opened(url, None)
    try:
        return [record async for record in store.scan()]
    finally:
        await store.aclose()


async def _verify(url: str, keys: list[ChainKey], anchors: list[Anchor] | None = None,
                  **options: bool):  # type: ignore[no-untyped-def]
    store = await _opened(url, None)
    try:
        return await verify(store.scan(), keys, anchors or [], **options)
    finally:
        await store.aclose()


async def _replace_trail(url: str, records: list[AuditRecord]) -> None:
    """What an attacker with write access to the database does: every row replaced."""
    rows = [tuple(getattr(record, name) for name in FIELDS) for record in records]
    columns = ", ".join(FIELDS)
    if url.startswith("sqlite"):
        with sqlite3.connect(sqlite_path(url)) as db:
            db.execute(f"DELETE FROM {TABLE}")
            db.executemany(f"INSERT INTO {TABLE} ({columns}) VALUES "
                           f"({', '.join('?' for _ in FIELDS)})", rows)
        return
    conn = await asyncpg.connect(url)
    try:
        async with conn.transaction():
            await conn.execute(f"DELETE FROM {TABLE}")
            await conn.executemany(
                f"INSERT INTO {TABLE} ({columns}) VALUES "
                f"({', '.join(f'${i}' for i in range(1, len(FIELDS) + 1))})", rows)
    finally:
        await conn.close()


def _rechained(records: list[AuditRecord], key: ChainKey | None) -> list[AuditRecord]:
    """``records`` with the second one's arguments changed and the chain recomputed from
    it (with ``key``, or unkeyed)."""
    changed = [dataclasses.replace(record) for record in records]
    changed[1] = dataclasses.replace(changed[1], arguments='{"text":"nothing to see"}')
    return [*changed[:1], *seal(changed[1:], changed[0].seq, changed[0].hash, key)]


async def _keyed_trail(url: str, count: int = 5) -> Anchor:
    store = await _opened(url, KEY)
    try:
        stored = await store.append([make_record(tool=f"t{i}") for i in range(count)])
    finally:
        await store.aclose()
    return Anchor(stored[-1].hash, stored[-1].seq)


async def test_a_keyed_trail_verifies_with_its_key_only(store_url: str) -> None:
    anchor = await _keyed_trail(store_url)

    report = await _verify(store_url, [KEY], [anchor])
    without = await _verify(store_url, [])
    wrong = await _verify(store_url, [OTHER_KEY])

    assert report.intact and report.checked == 5 and report.keyed == 5
    assert report.anchors == 1 and report.head_hash == anchor.head_hash
    assert {record.key_id for record in await _trail(store_url)} == {KEY.id}
    for failed in (without, wrong):
        assert failed.bad_seq == 1 and KEY.id in failed.reason and "not given" in failed.reason


async def test_a_database_writer_without_the_key_cannot_rechain(store_url: str) -> None:
    await _keyed_trail(store_url)
    records = await _trail(store_url)

    # Re-hashed as if unkeyed, the key id kept: the HMAC does not match.
    unkeyed = _rechained(records, None)
    await _replace_trail(store_url, [unkeyed[0], *(dataclasses.replace(r, key_id=KEY.id)
                                                   for r in unkeyed[1:])])
    kept_id = await _verify(store_url, [KEY])
    # Re-hashed unkeyed, the key id dropped from the records it rewrote.
    await _replace_trail(store_url, _rechained(records, None))
    dropped_id = await _verify(store_url, [KEY])
    # Re-hashed with a key of its own.
    await _replace_trail(store_url, _rechained(records, OTHER_KEY))
    own_key = await _verify(store_url, [KEY])

    assert kept_id.bad_seq == 2 and "does not match" in kept_id.reason
    assert dropped_id.bad_seq == 2 and "not keyed, after keyed records" in dropped_id.reason
    assert own_key.bad_seq == 2 and OTHER_KEY.id in own_key.reason


async def test_a_whole_trail_rewritten_unkeyed_fails_on_require_key_and_on_an_anchor(
        store_url: str) -> None:
    anchor = await _keyed_trail(store_url)
    records = await _trail(store_url)
    forged = seal([dataclasses.replace(r, key_id="") for r in records], 0, GENESIS_HASH)
    await _replace_trail(store_url, forged)

    lenient = await _verify(store_url, [KEY])
    strict = await _verify(store_url, [KEY], require_key=True)
    anchored = await _verify(store_url, [KEY], [anchor])

    # Read as a trail from before keys: intact, but reported as unkeyed.
    assert lenient.intact and lenient.unkeyed == 5 and lenient.keyed == 0
    assert strict.bad_seq == 1 and "--require-key" in strict.reason
    assert anchored.bad_seq == 5 and "anchor" in anchored.reason


async def test_someone_with_the_key_is_caught_by_an_anchor_taken_before(
        store_url: str) -> None:
    anchor = await _keyed_trail(store_url)
    await _replace_trail(store_url, _rechained(await _trail(store_url), KEY))

    unanchored = await _verify(store_url, [KEY])
    anchored = await _verify(store_url, [KEY], [anchor])

    assert unanchored.intact  # the key alone cannot tell: the chain is a valid keyed chain
    assert not anchored.intact and anchored.bad_seq == 5
    assert "anchor" in anchored.reason


async def test_a_cut_tail_and_a_deleted_trail_are_caught_by_an_anchor(store_url: str) -> None:
    anchor = await _keyed_trail(store_url)
    await execute_raw(store_url, f"DELETE FROM {TABLE} WHERE seq > 3")
    cut = await _verify(store_url, [KEY], [anchor])
    cut_unanchored = await _verify(store_url, [KEY])
    await execute_raw(store_url, f"DELETE FROM {TABLE}")
    deleted = await _verify(store_url, [KEY], [anchor])

    assert cut_unanchored.intact and cut_unanchored.checked == 3
    assert not cut.intact and cut.checked == 3
    assert "ends at seq 3, before the anchor at seq 5" in cut.reason
    assert not deleted.intact and "ends at seq 0" in deleted.reason


async def test_an_anchor_of_an_earlier_point_holds_while_the_trail_grows(
        store_url: str) -> None:
    early = await _keyed_trail(store_url, count=3)
    later = await _keyed_trail(store_url, count=2)

    report = await _verify(store_url, [KEY], [early, later, Anchor(GENESIS_HASH, 0)])

    assert report.intact and report.checked == 5 and report.anchors == 3
    assert str(later) == f"{later.head_hash}:5" and Anchor.parse(str(later)) == later


async def test_a_trail_from_before_keys_keeps_verifying_and_then_goes_on_keyed(
        store_url: str) -> None:
    old = await _opened(store_url, None)
    await old.append([make_record() for _ in range(3)])
    await old.aclose()
    # As a version before keys left it: no key_id column at all.
    await execute_raw(store_url, f"ALTER TABLE {TABLE} DROP COLUMN key_id")

    before = await _verify(store_url, [])
    await _keyed_trail(store_url, count=2)  # opened by this version, with a key
    after = await _verify(store_url, [KEY])
    strict = await _verify(store_url, [KEY], require_key=True)

    assert before.intact and before.unkeyed == 3
    assert after.intact and (after.unkeyed, after.keyed) == (3, 2)
    assert strict.bad_seq == 1


def test_the_key_file_is_made_once_private_and_then_reused(tmp_path: Path) -> None:
    path = tmp_path / "new" / "audit-hmac.key"
    previous = os.umask(0o002)
    try:
        made = load_or_create_key(path)
    finally:
        os.umask(previous)

    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert load_or_create_key(path) == made == load_key(path)
    assert len(path.read_text().strip()) == 64 and made.id not in path.read_text()
    assert [p.name for p in path.parent.iterdir()] == ["audit-hmac.key"]


def test_a_short_or_unreadable_key_file_is_refused(tmp_path: Path) -> None:
    short = tmp_path / "short.key"
    short.write_text("too short\n")

    with pytest.raises(AuditKeyError, match="at least 32 bytes"):
        load_key(short)
    with pytest.raises(AuditKeyError, match="cannot read"):
        load_key(tmp_path / "missing.key")
    assert "secret" not in repr(KEY) and "kkkk" not in repr(KEY)
