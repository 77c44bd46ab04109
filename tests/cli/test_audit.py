"""``stargrpc audit verify|tail|query`` on real stores (a SQLite file, PostgreSQL)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import sqlite3
import stat
import subprocess
import sys
import tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from click.testing import CliRunner

from stargrpc.audit.chain import seal
from stargrpc.audit.key import load_key, load_or_create_key
from stargrpc.audit.record import AuditRecord, format_time
from stargrpc.audit.store import open_store
from stargrpc.cli import main
from stargrpc.cli.audit import EXIT_BROKEN, EXIT_NO_STORE
from tests.audit.helpers import pg_schema
from tests.audit.records import make_record
from tests.procs import IMAGE_UID


def _fill(url: str, count: int = 5) -> None:
    now = datetime.now(UTC)

    async def fill() -> None:
        store = open_store(url)
        await store.open()
        await store.append([
            make_record(tool="sleep" if i % 2 else "echo",
                        principal="bob" if i == 3 else "alice",
                        outcome="timeout" if i == 1 else "ok",
                        time=format_time(now - timedelta(hours=count - i)),
                        run_id=f"run{i}")
            for i in range(count)])
        await store.aclose()

    asyncio.run(fill())


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["audit", *args])
    return result.exit_code, result.output


@pytest.fixture
def db(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'audit.db'}"
    _fill(url)
    return url


def test_verify_passes_on_an_intact_store(db: str) -> None:
    code, out = _cli("verify", "--store", db)

    assert code == 0, out
    assert out.startswith("ok: 5 records, chain intact")


def test_verify_names_the_first_changed_record(db: str) -> None:
    with sqlite3.connect(db.split(":///", 1)[1]) as conn:
        conn.execute("UPDATE audit_records SET outcome = 'ok' WHERE seq = 2")

    code, out = _cli("verify", "--store", db)

    assert code == EXIT_BROKEN
    assert "BROKEN at record seq 2" in out
    assert "changed" in out


def test_verify_names_the_record_after_a_deleted_one(db: str) -> None:
    with sqlite3.connect(db.split(":///", 1)[1]) as conn:
        conn.execute("DELETE FROM audit_records WHERE seq = 4")

    code, out = _cli("verify", "--store", db)

    assert code == EXIT_BROKEN
    assert "seq 5" in out and "missing" in out


def test_the_store_comes_from_the_environment_and_state_dir(
        db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STARGRPC_AUDIT_STORE", db)
    assert _cli("verify")[0] == 0
    monkeypatch.delenv("STARGRPC_AUDIT_STORE")
    monkeypatch.setenv("STARGRPC_STATE_DIR", str(tmp_path / "empty"))

    code, out = _cli("verify")

    assert code == EXIT_NO_STORE
    assert "no audit database" in out


def test_tail_prints_the_newest_records_oldest_first(db: str) -> None:
    code, out = _cli("tail", "--store", db, "-n", "2")

    assert code == 0
    lines = out.splitlines()
    assert len(lines) == 2
    assert "#4" in lines[0] and "run=run3" in lines[0] and "bob" in lines[0]
    assert "#5" in lines[1]


def test_query_filters_and_json(db: str) -> None:
    code, out = _cli("query", "--store", db, "--tool", "sleep", "--json")
    assert code == 0
    assert [json.loads(line)["run_id"] for line in out.splitlines()] == ["run1", "run3"]

    assert _cli("query", "--store", db, "--principal", "bob")[1].count("\n") == 1
    assert "run1" in _cli("query", "--store", db, "--outcome", "timeout")[1]
    recent = _cli("query", "--store", db, "--since", "150m", "--json")[1]
    assert [json.loads(line)["seq"] for line in recent.splitlines()] == [4, 5]
    since = format_time(datetime.now(UTC) - timedelta(minutes=150))
    assert _cli("query", "--store", db, "--since", since, "--json")[1] == recent


def test_a_bad_since_is_a_usage_error(db: str) -> None:
    code, out = _cli("query", "--store", db, "--since", "yesterday-ish")

    assert code == 2
    assert "ISO 8601" in out


async def test_verify_on_postgresql() -> None:
    async with pg_schema() as pg_url:
        store = open_store(pg_url)
        await store.open()
        await store.append([make_record() for _ in range(3)])
        await store.aclose()
        # The CLI runs its own event loop: give it a thread of its own.
        code, out = await asyncio.to_thread(_cli, "verify", "--store", pg_url)

    assert code == 0, out
    assert "3 records" in out


def test_tail_follow_prints_records_as_they_arrive(db: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "stargrpc.cli", "audit", "tail", "--store", db, "-n", "1",
         "--follow", "--interval", "0.1"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert "#5" in proc.stdout.readline()  # the newest record that was already there

        async def add() -> None:
            store = open_store(db)
            await store.open()
            await store.append([make_record(run_id="later")])
            await store.aclose()

        asyncio.run(add())
        assert "run=later" in proc.stdout.readline()  # blocks until it is printed
    finally:
        proc.terminate()
        proc.wait(10)


def _fill_keyed(url: str, key_file: Path, count: int = 5) -> None:
    async def fill() -> None:
        store = open_store(url, load_or_create_key(key_file))
        await store.open()
        await store.append([make_record(tool=f"t{i}") for i in range(count)])
        await store.aclose()

    asyncio.run(fill())


def test_anchor_then_verify_against_it_catches_a_rechained_or_cut_trail(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STARGRPC_STATE_DIR", str(tmp_path / "state"))  # no key there
    db, key_file = f"sqlite:///{tmp_path / 'audit.db'}", tmp_path / "audit.key"
    _fill_keyed(db, key_file)

    code, out = _cli("anchor", "--store", db, "--key-file", str(key_file))
    assert code == 0, out
    anchor = out.strip()
    assert anchor.endswith(":5") and len(anchor) == 64 + 2
    anchors = tmp_path / "anchors.txt"
    anchors.write_text(f"# kept away from the database\n{anchor}\n")

    code, out = _cli("verify", "--store", db, "--key-file", str(key_file), "--anchor", anchor)
    assert code == 0, out
    assert "5 keyed" in out and "1 anchor met" in out
    code, out = _cli("verify", "--store", db)  # the key is not found
    assert code == EXIT_BROKEN
    assert "not given (--key-file)" in out

    # Someone with the database and the key changes record 2 and re-chains the rest.
    with sqlite3.connect(db.split(":///", 1)[1]) as conn:
        rows = conn.execute("SELECT * FROM audit_records ORDER BY seq").fetchall()
        names = [c[0] for c in conn.execute("SELECT * FROM audit_records").description]
    records = [AuditRecord.from_dict(dict(zip(names, row, strict=True))) for row in rows]
    records[1] = dataclasses.replace(records[1], outcome="denied")
    forged = [records[0], *seal(records[1:], 1, records[0].hash, load_key(key_file))]
    with sqlite3.connect(db.split(":///", 1)[1]) as conn:
        for record in forged:
            conn.execute("UPDATE audit_records SET outcome = ?, prev_hash = ?, hash = ? "
                         "WHERE seq = ?", (record.outcome, record.prev_hash, record.hash,
                                           record.seq))

    assert _cli("verify", "--store", db, "--key-file", str(key_file))[0] == 0
    code, out = _cli("verify", "--store", db, "--key-file", str(key_file),
                     "--anchor", str(anchors))
    assert code == EXIT_BROKEN
    assert "BROKEN at record seq 5" in out and "anchor" in out

    with sqlite3.connect(db.split(":///", 1)[1]) as conn:
        conn.execute("DELETE FROM audit_records WHERE seq > 2")
    code, out = _cli("verify", "--store", db, "--key-file", str(key_file), "--anchor", anchor)
    assert code == EXIT_BROKEN
    assert "ends at seq 2, before the anchor at seq 5" in out


def test_a_bad_anchor_is_a_usage_error(db: str) -> None:
    code, out = _cli("verify", "--store", db, "--anchor", "nothex:5")

    assert code == 2
    assert "not an anchor" in out


def test_verify_reports_records_from_before_keys(db: str, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STARGRPC_STATE_DIR", str(tmp_path / "state"))
    _fill_keyed(db, tmp_path / "audit.key", count=2)

    code, out = _cli("verify", "--store", db, "--key-file", str(tmp_path / "audit.key"))
    strict = _cli("verify", "--store", db, "--key-file", str(tmp_path / "audit.key"),
                  "--require-key")

    assert code == 0, out
    assert "2 keyed; 5 unkeyed (seq 1-5, written before the trail had a key" in out
    assert strict[0] == EXIT_BROKEN and "--require-key" in strict[1]


def test_verify_finds_the_default_key_beside_a_sqlite_trail_named_by_store(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A state folder copied elsewhere (a backup, another machine): --store names its
    # database, and the key the server made beside it is found without --key-file.
    monkeypatch.setenv("STARGRPC_STATE_DIR", str(tmp_path / "elsewhere"))
    copy = tmp_path / "copy"
    copy.mkdir()
    db = f"sqlite:///{copy / 'audit.db'}"
    _fill_keyed(db, copy / "audit-hmac.key", count=3)

    code, out = _cli("verify", "--store", db)

    assert code == 0, out
    assert "3 keyed" in out


def _folder_state(folder: Path) -> tuple[dict[str, tuple[int, int, int]], int]:
    """Every file of ``folder`` (mode, mtime, size) and the folder's own mtime."""
    files = {path.name: (stat.S_IMODE(path.stat().st_mode), path.stat().st_mtime_ns,
                         path.stat().st_size) for path in folder.iterdir()}
    return files, folder.stat().st_mtime_ns


def test_the_audit_commands_change_nothing_they_read(db: str, tmp_path: Path) -> None:
    path = Path(db.split(":///", 1)[1])
    path.chmod(0o640)  # a mode the server would narrow: a reader must leave it
    before = _folder_state(tmp_path)

    for args in (("verify",), ("anchor",), ("tail",), ("query", "--tool", "echo")):
        code, out = _cli(*args, "--store", db)
        assert code == 0, (args, out)

    assert _folder_state(tmp_path) == before  # no mode, time, size or -wal/-shm changed


async def test_verify_reads_a_trail_a_server_has_open_and_adds_no_file(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'audit.db'}"
    writer = open_store(url)
    await writer.open()
    try:
        await writer.append([make_record() for _ in range(3)])  # in the WAL, not yet copied
        before = _folder_state(tmp_path)
        assert {"audit.db-wal", "audit.db-shm"} <= before[0].keys()

        result = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "stargrpc.cli", "audit", "verify", "--store",
                             url], capture_output=True, text=True, timeout=60)
        after = _folder_state(tmp_path)
        await writer.append([make_record()])  # the writer goes on as before
    finally:
        await writer.aclose()

    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok: 3 records, chain intact")
    assert after[0].keys() == before[0].keys()
    assert after[0]["audit.db"] == before[0]["audit.db"]


def test_verify_works_on_a_trail_its_user_may_only_read() -> None:
    folder = Path(tempfile.mkdtemp(prefix="stargrpc-read-only-"))
    try:
        url = f"sqlite:///{folder / 'audit.db'}"
        _fill(url)
        if os.geteuid() == 0:  # root reads and writes anything: verify as another user
            (folder / "audit.db").chmod(0o644)
            folder.chmod(0o755)
            prefix = ["setpriv", f"--reuid={IMAGE_UID}", f"--regid={IMAGE_UID}",
                      "--clear-groups", "--"]
        else:
            (folder / "audit.db").chmod(0o444)
            folder.chmod(0o555)
            prefix = []
        before = _folder_state(folder)

        result = subprocess.run(
            [*prefix, sys.executable, "-m", "stargrpc.cli", "audit", "verify", "--store", url],
            capture_output=True, text=True, timeout=60, cwd=folder,
            env={**os.environ, "STARGRPC_STATE_DIR": str(folder), "HOME": str(folder)})

        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stdout.startswith("ok: 5 records, chain intact")
        assert _folder_state(folder) == before
    finally:
        folder.chmod(0o755)
        shutil.rmtree(folder, ignore_errors=True)


def test_verify_reads_a_trail_an_older_version_wrote_without_changing_it(db: str) -> None:
    path = db.split(":///", 1)[1]
    with sqlite3.connect(path) as conn:  # as a version before keys left it
        conn.execute("ALTER TABLE audit_records DROP COLUMN key_id")

    code, out = _cli("verify", "--store", db)

    assert code == 0, out
    assert out.startswith("ok: 5 records, chain intact") and "(5 unkeyed" in out
    with sqlite3.connect(path) as conn:
        columns = {row[1] for row in conn.execute("PRAGMA table_info(audit_records)")}
    assert "key_id" not in columns  # the next server adds it, not a reader


def test_verify_on_a_file_that_holds_no_trail_says_so(tmp_path: Path) -> None:
    path = tmp_path / "other.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE notes (text TEXT)")

    code, out = _cli("verify", "--store", f"sqlite:///{path}")

    assert code == EXIT_NO_STORE
    assert f"{path} holds no audit trail" in out
