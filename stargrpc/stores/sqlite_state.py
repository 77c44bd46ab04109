"""Run state kept across restarts by an embedded server: :class:`SqliteStateStore`, in
``<state_dir>/state.db``, when the operator asks for it (``state_persist``).

The same :class:`~stargrpc.stores.base.StateStore` as the memory store, with the same
semantics (quota of key and value bytes per scope, entry ttls, a scope's retention once its
run or tree ends), but on disk: WAL journal, one connection used from the event loop's
thread, each operation one transaction (so each is atomic, as the protocol asks; one
process only: a fleet keeps its state in Redis). Times are wall-clock (``time.time()``),
so a retention or ttl that ran out while the server was down has run out when it is back.

Commits use ``synchronous=NORMAL``: a power cut may lose the last moments of writes, never
corrupt the file; a process crash loses nothing.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import structlog

from stargrpc.errors import Unavailable
from stargrpc.stores.base import (
    STATE_MISMATCH,
    STATE_NOT_INTEGER,
    STATE_OVER_QUOTA,
    STATE_WRITTEN,
    StateWrite,
)

log = structlog.get_logger("stargrpc.stores")

#: Largest integer ``increment`` keeps (exact in every store).
_MAX_INTEGER = 2**53 - 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS state_scopes (
    scope TEXT PRIMARY KEY,
    size INTEGER NOT NULL,
    expires REAL
);
CREATE INDEX IF NOT EXISTS state_scopes_expires ON state_scopes (expires)
    WHERE expires IS NOT NULL;
CREATE TABLE IF NOT EXISTS state_entries (
    scope TEXT NOT NULL,
    key TEXT NOT NULL,
    value TEXT NOT NULL,
    expires REAL,
    PRIMARY KEY (scope, key)
) WITHOUT ROWID;
"""


def _size(key: str, value: str) -> int:
    return len(key.encode()) + len(value.encode())


def _is_integer(text: str) -> bool:
    body = text[1:] if text.startswith("-") else text
    return body.isascii() and body.isdigit()


class SqliteStateStore:
    """Run state in a SQLite file (see the module docstring)."""

    path: Path
    _db: sqlite3.Connection

    def __init__(self, path: Path) -> None:
        """Opens (or makes) the file, readable by the server's user alone.

        Raises:
            sqlite3.Error, OSError: It cannot be opened.
        """
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        path.touch(mode=0o600, exist_ok=True)
        self.path = path
        self._db = sqlite3.connect(path, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        """Closes the file."""
        self._db.close()

    # -- one transaction per operation --------------------------------------------------------

    def _scope(self, scope: str, now: float) -> tuple[int, float | None] | None:
        row = self._db.execute("SELECT size, expires FROM state_scopes WHERE scope = ?",
                               (scope,)).fetchone()
        if row is not None and row[1] is not None and row[1] <= now:
            self._drop_scope(scope)
            return None
        return row

    def _drop_scope(self, scope: str) -> None:
        self._db.execute("DELETE FROM state_entries WHERE scope = ?", (scope,))
        self._db.execute("DELETE FROM state_scopes WHERE scope = ?", (scope,))

    def _sweep(self, now: float) -> None:
        for (scope,) in self._db.execute(
                "SELECT scope FROM state_scopes WHERE expires IS NOT NULL AND expires <= ?",
                (now,)).fetchall():
            self._drop_scope(scope)

    def _live(self, scope: str, key: str, now: float) -> str | None:
        row = self._db.execute("SELECT value, expires FROM state_entries WHERE scope = ? AND "
                               "key = ?", (scope, key)).fetchone()
        if row is None:
            return None
        if row[1] is not None and row[1] <= now:
            self._db.execute("DELETE FROM state_entries WHERE scope = ? AND key = ?",
                             (scope, key))
            self._db.execute("UPDATE state_scopes SET size = size - ? WHERE scope = ?",
                             (_size(key, row[0]), scope))
            return None
        return str(row[0])

    def _drop_expired(self, scope: str, now: float) -> int:
        """Removes the scope's expired entries; its size after."""
        self._db.execute("DELETE FROM state_entries WHERE scope = ? AND expires IS NOT NULL "
                         "AND expires <= ?", (scope, now))
        size = self._db.execute(
            "SELECT COALESCE(SUM(LENGTH(CAST(key AS BLOB)) + LENGTH(CAST(value AS BLOB))), 0) "
            "FROM state_entries WHERE scope = ?", (scope,)).fetchone()[0]
        self._db.execute("UPDATE state_scopes SET size = ? WHERE scope = ?", (size, scope))
        return int(size)

    def _write(self, scope: str, key: str, old: str | None, value: str, write: StateWrite,
               now: float) -> str:
        held = self._scope(scope, now)
        if held is None:
            self._db.execute("INSERT INTO state_scopes (scope, size, expires) VALUES (?, 0, ?)",
                             (scope, None))
            held = (0, None)
        size, expires = held
        grows = _size(key, value) - (_size(key, old) if old is not None else 0)
        if write.max_scope_bytes and grows > 0 and size + grows > write.max_scope_bytes:
            size = self._drop_expired(scope, now)
            if size + grows > write.max_scope_bytes:
                return STATE_OVER_QUOTA
        self._db.execute("INSERT OR REPLACE INTO state_entries (scope, key, value, expires) "
                         "VALUES (?, ?, ?, ?)",
                         (scope, key, value, now + write.ttl_ms / 1000 if write.ttl_ms
                          else None))
        self._db.execute("UPDATE state_scopes SET size = size + ?, expires = ? WHERE scope = ?",
                         (grows, now + write.scope_ttl_ms / 1000
                          if write.scope_ttl_ms and expires is None else expires, scope))
        return STATE_WRITTEN

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        try:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
        except sqlite3.Error as exc:  # a full disk, a broken file: STATE_UNAVAILABLE
            log.error("run_state_database_failed", path=str(self.path), error=str(exc))
            raise Unavailable(f"the run state database failed: {exc}") from None

    # -- the StateStore protocol ----------------------------------------------------------------

    async def get(self, scope: str, key: str) -> str | None:
        now = time.time()
        with self._transaction():
            value = None if self._scope(scope, now) is None else self._live(scope, key, now)
        return value

    async def put(self, scope: str, key: str, value: str, write: StateWrite, *,
                  conditional: bool = False, expected: str | None = None) -> str:
        now = time.time()
        with self._transaction():
            self._sweep(now)
            old = None if self._scope(scope, now) is None else self._live(scope, key, now)
            outcome = (STATE_MISMATCH if conditional and old != expected
                       else self._write(scope, key, old, value, write, now))
        return outcome

    async def increment(self, scope: str, key: str, by: int, write: StateWrite) -> int | str:
        now = time.time()
        with self._transaction():
            self._sweep(now)
            old = None if self._scope(scope, now) is None else self._live(scope, key, now)
            if old is not None and not _is_integer(old):
                outcome: int | str = STATE_NOT_INTEGER
            else:
                value = (int(old) if old is not None else 0) + by
                if abs(value) > _MAX_INTEGER:
                    outcome = STATE_NOT_INTEGER
                else:
                    written = self._write(scope, key, old, str(value), write, now)
                    outcome = value if written == STATE_WRITTEN else written
        return outcome

    async def delete(self, scope: str, key: str) -> bool:
        now = time.time()
        with self._transaction():
            held = self._scope(scope, now)
            old = None if held is None else self._live(scope, key, now)
            if old is not None:
                self._db.execute("DELETE FROM state_entries WHERE scope = ? AND key = ?",
                                 (scope, key))
                self._db.execute("UPDATE state_scopes SET size = size - ? WHERE scope = ?",
                                 (_size(key, old), scope))
                # A principal's emptied scope costs nothing.
                self._db.execute(
                    "DELETE FROM state_scopes WHERE scope = ? AND expires IS NULL AND NOT "
                    "EXISTS (SELECT 1 FROM state_entries WHERE scope = ?)", (scope, scope))
        return old is not None

    async def keys(self, scope: str, prefix: str) -> list[str]:
        now = time.time()
        with self._transaction():
            if self._scope(scope, now) is None:
                found: list[str] = []
            else:
                # Keys hold no LIKE wildcards but '_': compared by prefix in Python.
                found = [key for (key,) in self._db.execute(
                    "SELECT key FROM state_entries WHERE scope = ? AND key >= ? AND "
                    "(expires IS NULL OR expires > ?) ORDER BY key", (scope, prefix, now))
                    if key.startswith(prefix)]
        return found

    async def end_scope(self, scope: str, retention_ms: int) -> None:
        now = time.time()
        with self._transaction():
            self._db.execute("UPDATE state_scopes SET expires = ? WHERE scope = ?",
                             (now + retention_ms / 1000, scope))
