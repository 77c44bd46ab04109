"""The SQLite trail's files are private to the server's user: the database and its -wal
and -shm files 0600, the folders the store creates 0700, whatever the umask."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from stargrpc.audit.sqlite import SqliteAuditStore
from tests.audit.records import make_record


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def open_umask() -> Iterator[None]:
    """A umask that lets files be made readable by everyone (as a careless service might)."""
    previous = os.umask(0o002)
    yield
    os.umask(previous)


async def test_the_database_and_its_companions_are_0600_and_new_folders_0700(
        tmp_path: Path, open_umask: None) -> None:
    existing = tmp_path / "existing"
    existing.mkdir(mode=0o755)
    path = existing / "state" / "audit" / "trail.db"
    store = SqliteAuditStore(f"sqlite:///{path}")
    await store.open()
    try:
        await store.append([make_record()])
        modes = {name: _mode(Path(f"{path}{name}")) for name in ("", "-wal", "-shm")}
    finally:
        await store.aclose()

    assert modes == {"": 0o600, "-wal": 0o600, "-shm": 0o600}
    assert _mode(path.parent) == 0o700
    assert _mode(path.parent.parent) == 0o700
    assert _mode(existing) == 0o755  # a folder that was there is left as it was


async def test_an_existing_trail_open_to_others_is_narrowed(tmp_path: Path) -> None:
    path = tmp_path / "audit.db"
    store = SqliteAuditStore(f"sqlite:///{path}")
    await store.open()
    await store.append([make_record()])
    await store.aclose()
    path.chmod(0o644)  # as an older version made it

    reopened = SqliteAuditStore(f"sqlite:///{path}")
    await reopened.open()
    try:
        await reopened.append([make_record()])
        modes = {name: _mode(Path(f"{path}{name}")) for name in ("", "-wal", "-shm")}
    finally:
        await reopened.aclose()

    assert modes == {"": 0o600, "-wal": 0o600, "-shm": 0o600}
