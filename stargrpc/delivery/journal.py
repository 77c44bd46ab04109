"""The pending deliveries of a server without a fleet, kept in the state folder.

A lone server keeps its runs in memory, so a delivery it promised would die with the
process. Each one is written to ``<state_dir>/deliveries.db`` (SQLite, mode 0600) and
committed with ``synchronous=FULL`` before the call that asked for it is answered; its row
gets the Result's bytes once the run has ended, and goes once the delivery's final state is
known. A server that starts finds the rows a process that died left behind and delivers them:
the Result when the row holds it, else ``Result{ERROR, RUN_LOST}`` (the run died with the
process), as a fleet's replica does for a replica that died.

A row names the process that wrote it (its pid): a server takes over the rows of its own pid
(a restarted container's server is pid 1 again) and of pids no process holds, never those of
another live server sharing the folder.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path

from stargrpc.audit.sqlite import make_private_file
from stargrpc.delivery.target import DeliveryTarget

#: The journal's file name in the state folder.
JOURNAL_NAME = "deliveries.db"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS pending (
  run_id TEXT PRIMARY KEY,
  tool TEXT NOT NULL,
  target TEXT NOT NULL,
  pid INTEGER NOT NULL,
  result BLOB
)
"""


@dataclass(frozen=True)
class PendingDelivery:
    """A delivery a process left behind.

    Attributes:
        run_id: The run.
        tool: Its tool.
        target: Where its Result goes.
        result: The Result's bytes when the run had ended; None when it died unfinished.
    """

    run_id: str
    tool: str
    target: DeliveryTarget
    result: bytes | None


class DeliveryJournal:
    """The journal file; every method blocks (call it from a thread) and is thread-safe.

    Attributes:
        path: The SQLite file.
    """

    path: Path
    _db: sqlite3.Connection | None
    _lock: threading.Lock

    def __init__(self, path: Path) -> None:
        self.path = path
        self._db = None
        self._lock = threading.Lock()

    def _connection(self) -> sqlite3.Connection:
        if self._db is None:
            make_private_file(self.path)  # -wal and -shm get the file's mode: 0600 too
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False,
                                 timeout=10.0)
            db.execute("PRAGMA journal_mode=WAL")
            # A delivery promised to a caller must survive more than the process: fsync at
            # every commit.
            db.execute("PRAGMA synchronous=FULL")
            db.execute(_SCHEMA)
            self._db = db
        return self._db

    def add(self, run_id: str, tool: str, target: DeliveryTarget) -> None:
        """Keeps a new delivery (committed when this returns)."""
        with self._lock:
            self._connection().execute(
                "INSERT OR REPLACE INTO pending (run_id, tool, target, pid, result) "
                "VALUES (?, ?, ?, ?, NULL)", (run_id, tool, target.to_json(), os.getpid()))

    def set_result(self, run_id: str, result: bytes) -> None:
        """Keeps the Result of a delivery's run, which ended."""
        with self._lock:
            self._connection().execute("UPDATE pending SET result = ? WHERE run_id = ?",
                                       (result, run_id))

    def remove(self, run_id: str) -> None:
        """Forgets a delivery whose final state is known."""
        with self._lock:
            self._connection().execute("DELETE FROM pending WHERE run_id = ?", (run_id,))

    def left_behind(self) -> list[PendingDelivery]:
        """The deliveries of processes that are gone (or of this pid), which this process
        takes over: their rows now name it. A row that cannot be read is dropped."""
        if self._db is None and not self.path.exists():
            return []
        found: list[PendingDelivery] = []
        with self._lock:
            db = self._connection()
            rows = db.execute("SELECT run_id, tool, target, pid, result FROM pending").fetchall()
            for run_id, tool, target, pid, result in rows:
                if pid != os.getpid() and _alive(pid):
                    continue  # another server sharing the folder delivers it
                try:
                    found.append(PendingDelivery(run_id, tool, DeliveryTarget.from_json(target),
                                                 result))
                except (ValueError, KeyError, TypeError):
                    db.execute("DELETE FROM pending WHERE run_id = ?", (run_id,))
                    continue
                db.execute("UPDATE pending SET pid = ? WHERE run_id = ?", (os.getpid(), run_id))
        return found

    def close(self) -> None:
        """Closes the file (what it holds stays for the next start)."""
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
