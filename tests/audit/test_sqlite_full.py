"""A SQLite trail that runs out of space: the log names the real cause ("database or disk
is full"), and every record submitted meanwhile is written once space returns.

The file is made full the portable way — ``PRAGMA max_page_count`` at its current size on
the store's two connections — rather than a small tmpfs (mounting one needs root): SQLite
reports both as ``SQLITE_FULL`` and rolls the transaction back itself in both cases.
"""

from __future__ import annotations

import asyncio
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

from structlog.testing import capture_logs

from stargrpc.audit.chain import verify
from stargrpc.audit.sqlite import SqliteAuditStore
from stargrpc.audit.writer import AuditWriter
from tests.audit.records import make_record
from tests.helpers import eventually

WAIT = 30.0  # bound on waiting for the writer to log or to catch up; no performance claim
RECORDS = 20


def _limit_pages(db: Any, pages: int | None) -> None:
    if pages is None:  # the file's current size: the next page it needs is refused
        pages = db.execute("PRAGMA page_count").fetchone()[0]
    db.execute(f"PRAGMA max_page_count={pages}")


async def _set_limit(store: SqliteAuditStore, pages: int | None) -> None:
    # Both connections: the event loop's fast one and the one of the store's thread (a
    # connection is used on the thread that made it).
    assert store._fast is not None
    _limit_pages(store._fast, pages)
    await store._run(_limit_pages, store._conn, pages)


async def _logged(logs: list[MutableMapping[str, Any]], event: str) -> MutableMapping[str, Any]:
    found = await eventually(lambda: [line for line in logs if line["event"] == event],
                             within=WAIT, what=lambda: f"{event} logged: {logs}")
    return found[0]


async def test_a_full_trail_logs_why_and_loses_nothing(tmp_path: Path) -> None:
    store = SqliteAuditStore(f"sqlite:///{tmp_path / 'audit.db'}")
    writer = AuditWriter(store, close_timeout=5.0)
    await writer.start()
    try:
        await writer.submit(make_record())
        await _set_limit(store, None)
        big = "x" * 20_000  # more than a page: every record needs new pages
        with capture_logs() as logs:
            futures = [writer.submit(make_record(arguments=big, result=str(i)))
                       for i in range(RECORDS)]
            failed = await _logged(logs, "audit_write_failed")
            assert failed["error"] == "database or disk is full"
            assert not [line for line in logs if "no transaction" in str(line.get("error"))]
            assert not any(future.done() for future in futures)  # still waiting, not dropped

            await _set_limit(store, 1_000_000)  # space returns
            stored = await asyncio.wait_for(asyncio.gather(*futures), WAIT)
        assert [record.result for record in stored] == [str(i) for i in range(RECORDS)]
        records = [record async for record in store.scan()]
        assert len(records) == RECORDS + 1
        report = await verify(store.scan())
        assert report.intact and report.checked == RECORDS + 1
    finally:
        await writer.aclose()
