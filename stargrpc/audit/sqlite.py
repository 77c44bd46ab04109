"""The SQLite audit store: one file in WAL mode, the embedded default.

WAL lets readers (``stargrpc audit tail``) run while the server writes; ``BEGIN IMMEDIATE``
makes each append exclusive among writers, so two processes sharing the file still build
one chain. ``synchronous=NORMAL`` in WAL mode keeps every committed record across a crash
of the process (a power loss, or a disk that fails to write back what the page cache held,
can take the last commits).

An append (BEGIN IMMEDIATE, read the chain's head, seal, INSERT, COMMIT) is tried first
right on the event loop, on a connection that never waits: its busy timeout is zero and it
never checkpoints, so all it does is append a few pages to the WAL in the page cache —
less than the thread switches of handing it to a thread (``bench/README.md`` has the
figures). A disk that stalls stalls such an append, and the loop with it: with ``on_loop``
off (``audit_sqlite_append_on_loop``) every append is made on the thread. When another
writer holds the lock, or the fast attempt fails for any reason, the append goes to the
store's own thread, whose
connection waits for the lock (``busy_timeout``) and reports real errors. That thread also
checkpoints the WAL every :data:`CHECKPOINT_EVERY` fast commits, off the event loop and
without blocking appends, so the WAL file stays small.

A checkpoint measures the WAL when it starts, and appends go on while it runs: on a loaded
machine its fsync can outlast a whole burst of them. So the thread checkpoints again when
:data:`CHECKPOINT_EVERY` commits landed meanwhile (rather than waiting for a next commit
that may never come). Under steady appends a passive checkpoint never catches up with the
last commit, so the WAL never starts over by itself: once it has grown past
:data:`WAL_FRAMES_LIMIT` the thread restarts it (a checkpoint that waits for the last
frame), and meanwhile the loop hands its appends to the thread, behind the restart, instead
of keeping the write lock from it. A reader that keeps a snapshot open holds a restart back:
the restart waits a moment for it (:data:`RESTART_WAIT_SECONDS`), not the whole busy
timeout, and is tried again later; the WAL grows past its limit for as long as that reader
stays. The restarted WAL is written again from its start — overwriting a file is cheaper
than growing one, which is why it is not truncated to nothing — and ``journal_size_limit``
cuts it back to the limit whenever it starts over.

A store opened ``read_only`` (``stargrpc audit verify|anchor|tail|query``) writes nothing:
not the file, its mode, its schema or journal mode, nor ``-wal``/``-shm`` files beside it
(which a read-only connection could not remove again, and which would be its user's, in
the server's folder). See :class:`_ReadOnlyTrail`.
"""

from __future__ import annotations

import asyncio
import contextlib
import operator
import os
import queue
import sqlite3
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import structlog

from stargrpc.audit.chain import seal
from stargrpc.audit.key import ChainKey, make_private_folders
from stargrpc.audit.record import FIELDS, GENESIS_HASH, AuditRecord
from stargrpc.audit.sql import (
    ADDED_COLUMNS,
    TABLE,
    Query,
    scan_in_batches,
    schema_sql,
    select_sql,
    sqlite_path,
)

# Record ids are not UNIQUE in a file made by this version: nothing looks a record up by
# its id, and the constraint's index was a b-tree more written on every append (measured
# in bench/README.md). Ids are version-7 UUIDs (74 random bits within each
# millisecond), and a row added behind the writer's back breaks the chain anyway. Files
# made by older versions keep their constraint (dropping it takes a rebuild of the table).
_TYPES = {"seq": "INTEGER PRIMARY KEY", "id": "TEXT NOT NULL",
          "duration_ms": "REAL NOT NULL", "privileged": "INTEGER NOT NULL"}

# Indexed by time only (besides seq): every index is a page more to write on every append,
# and the time index bounds a query by tool or principal to its time range. An index keyed
# by something random (a run id) would dirty a page anywhere in its b-tree on every append;
# records' times grow, so their index is written at its end.
_SCHEMA = schema_sql(_TYPES, indexed=("time",))

_INSERT = (f"INSERT INTO {TABLE} ({', '.join(FIELDS)}) "
           f"VALUES ({', '.join('?' for _ in FIELDS)})")

_HEAD = f"SELECT seq, hash FROM {TABLE} ORDER BY seq DESC LIMIT 1"

_T = TypeVar("_T")

#: Fast commits on the event loop between two WAL checkpoints on the store's thread.
CHECKPOINT_EVERY = 500

#: WAL pages past which a checkpoint starts the WAL over even though appends wait meanwhile
#: (about 40 MiB with 4 KiB pages); also the size the WAL file is cut back to when it
#: starts over.
WAL_FRAMES_LIMIT = 10_000

#: Checkpoints one hand-over to the thread runs at most, one more each time appends went
#: on meanwhile (the next commit hands over again).
_CHECKPOINT_ROUNDS = 20

#: How long the store's connection waits for a lock another connection holds (appends on
#: the thread wait for the write lock this long before they fail and are retried).
BUSY_TIMEOUT_SECONDS = 10.0

#: How long a restart of the WAL waits for readers to leave it. Appends wait behind a
#: restart, so a reader that keeps a snapshot open (a backup, a forgotten transaction in a
#: shell) must not hold them for the whole busy timeout: the restart gives up instead, and
#: is tried again after the next CHECKPOINT_EVERY commits.
RESTART_WAIT_SECONDS = 0.25

log = structlog.get_logger("stargrpc.audit")


class SqliteAuditStore:
    """An audit trail in a SQLite file.

    Attributes:
        url: ``sqlite:///PATH``.
        key: The audit key appended records are keyed with (None: unkeyed).
        read_only: Opened to read only: :meth:`append` refuses, and nothing is written.
    """

    url: str
    key: ChainKey | None
    read_only: bool
    on_loop: bool
    _reader: _ReadOnlyTrail | None
    _db: sqlite3.Connection | None
    _fast: sqlite3.Connection | None
    _thread: _StoreThread | None
    _commits_since_checkpoint: int
    _checkpointing: bool
    _restarting: bool

    def __init__(self, url: str, key: ChainKey | None = None, *,
                 read_only: bool = False, on_loop: bool = True) -> None:
        """A store on the file ``url`` names (opened by :meth:`open`).

        Args:
            url: ``sqlite:///PATH``.
            key: The audit key appended records are keyed with (None: unkeyed).
            read_only: Only read: the file must exist, and neither it nor its folder is
                changed (for the ``stargrpc audit`` commands).
            on_loop: Try each append on the event loop first (:meth:`append_now`); off,
                every append is made on the store's thread.
        """
        self.url = url
        self.key = key
        self.read_only = read_only
        self.on_loop = on_loop
        self._reader = None
        self._db = None
        self._fast = None
        self._thread = None
        self._commits_since_checkpoint = 0
        self._checkpointing = False
        self._restarting = False

    async def open(self) -> None:
        path = sqlite_path(self.url)
        if self.read_only:
            self._thread = _StoreThread()
            self._reader = _ReadOnlyTrail(path)
            try:
                await self._run(self._reader.check)
            except BaseException:
                await self.aclose()
                raise
            return
        make_private_file(path)
        # One thread owns the connection: sqlite3's own same-thread check stays on.
        self._thread = _StoreThread()
        try:
            self._db = await self._run(_connect, str(path))
            if self.on_loop:
                self._fast = _connect_fast(str(path))
        except BaseException:
            if self._db is not None:
                await self._run(self._db.close)
                self._db = None
            self._thread.stop()
            self._thread = None
            raise

    async def _run(self, function: Callable[..., _T], *args: object) -> _T:
        if self._thread is None:
            raise RuntimeError("the audit store is not open")
        return await self._thread.run(function, *args)

    @property
    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            raise RuntimeError("the audit store is not open")
        return self._db

    async def append(self, records: Sequence[AuditRecord]) -> list[AuditRecord]:
        if self.read_only:
            raise RuntimeError("the audit store is open read-only")
        sealed = self.append_now(records)
        if sealed is not None:
            return sealed
        return await self._run(_append, self._conn, records, self.key)

    @staticmethod
    def refuses(exc: BaseException) -> bool:
        """Whether ``exc``, raised by :meth:`append`, says the records themselves cannot be
        stored (a constraint such as a NaN duration, which SQLite stores as NULL; a value
        SQLite cannot bind, an integer too large; a text too big), so trying them again
        fails again — unlike a locked, full, read-only or failing file (OperationalError),
        which is the store's trouble and passes."""
        return isinstance(exc, (sqlite3.IntegrityError, sqlite3.DataError,
                                sqlite3.ProgrammingError, sqlite3.InterfaceError,
                                OverflowError, TypeError, ValueError))

    def append_now(self, records: Sequence[AuditRecord]) -> list[AuditRecord] | None:
        """Appends ``records`` right here on the event loop when that needs no waiting.

        Returns:
            The records as stored, or None when another writer holds the lock (or the
            attempt failed): then :meth:`append` must do it on the store's thread.
        """
        if self._fast is None or self._restarting:
            return None
        try:
            sealed = _append(self._fast, records, self.key)
        except sqlite3.Error:
            return None  # locked by another writer, or failing: the thread waits and reports
        try:
            self._fast_committed()
        except Exception:  # committed all the same: this must not make them declined
            log.exception("audit_checkpoint_not_scheduled")
        return sealed

    def _fast_committed(self) -> None:
        self._commits_since_checkpoint += 1
        if (self._commits_since_checkpoint >= CHECKPOINT_EVERY and not self._checkpointing
                and self._thread is not None):
            # One at a time: checkpoints queued behind each other would only repeat work.
            self._commits_since_checkpoint = 0
            self._checkpointing = True
            self._thread.submit(self._checkpoint_on_thread, self._conn)

    def _checkpoint_on_thread(self, db: sqlite3.Connection) -> None:
        try:
            for _ in range(_CHECKPOINT_ROUNDS):
                if _checkpoint_passive(db) > WAL_FRAMES_LIMIT:
                    # Plain flags: read on the loop, written here.
                    self._restarting = True
                    try:
                        _restart_wal(db)
                    finally:
                        self._restarting = False
                if self._commits_since_checkpoint < CHECKPOINT_EVERY:
                    return
                self._commits_since_checkpoint = 0  # a count lost to a race: harmless
        finally:
            self._checkpointing = False

    async def query(self, query: Query) -> list[AuditRecord]:
        sql, params = select_sql(TABLE, query, "?")
        if self._reader is not None:
            return await self._run(self._reader.select, sql, params)
        return await self._run(_select, self._conn, sql, params)

    def scan(self, batch: int = 1000) -> AsyncIterator[AuditRecord]:
        return scan_in_batches(self.query, batch)

    async def aclose(self) -> None:
        if self._thread is None:
            return
        if self._fast is not None:
            self._fast.close()
            self._fast = None
        if self._db is not None:
            await self._run(self._db.close)
            self._db = None
        if self._reader is not None:
            await self._run(self._reader.close)
            self._reader = None
        self._thread.stop()
        self._thread = None


#: Reads of a trail at rest tried before giving up, when a writer keeps changing it under
#: each of them.
_READ_ATTEMPTS = 5


class _ReadOnlyTrail:
    """The connection of a read-only store, which makes no file and changes none.

    A trail a server has open has its ``-wal`` and ``-shm`` files: it is read through them
    (``mode=ro``), as a reader beside the writer. A trail at rest has none, and a
    ``mode=ro`` connection would create them (and leave them: it cannot remove them again)
    or, where it may not, fail; so it is read as the single file it is (``immutable=1``:
    no companion, no lock). A writer may come meanwhile: it writes its WAL first and the
    database file only when it checkpoints, so a read at rest is kept only if the file was
    not written (nor a WAL begun) while it ran, and is otherwise read again. Used on the
    store's thread only.
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        self._companions = (Path(f"{path}-wal"), Path(f"{path}-shm"))
        self._db: sqlite3.Connection | None = None
        self._opened_for: tuple[object, ...] = ()
        self._columns = ""

    def _state(self) -> tuple[object, ...]:
        """Which way the trail is read now, and what a write would change."""
        try:
            wal, shm = (os.stat(companion) for companion in self._companions)
        except FileNotFoundError:
            found = os.stat(self._path)  # FileNotFoundError: no trail at all
            return ("at rest", found.st_ino, found.st_size, found.st_mtime_ns)
        return ("open", wal.st_ino, shm.st_ino)

    def _connection(self, state: tuple[object, ...]) -> sqlite3.Connection:
        if self._db is not None and state == self._opened_for:
            return self._db
        self.close()
        uri = "file:" + urllib.request.pathname2url(str(self._path.resolve())) + "?mode=ro"
        if state[0] == "at rest":
            uri += "&immutable=1"
        db = sqlite3.connect(uri, uri=True, isolation_level=None)
        try:
            columns = {row[1] for row in db.execute(f"PRAGMA table_info({TABLE})")}
            if not columns:
                raise sqlite3.OperationalError(f"{self._path} holds no audit trail")
        except BaseException:
            db.close()
            raise
        # A file an older version wrote may lack the columns added since: empty in its rows.
        self._columns = ", ".join(name if name in columns or name not in ADDED_COLUMNS
                                  else f"'' AS {name}" for name in FIELDS)
        self._db, self._opened_for = db, state
        return db

    def check(self) -> None:
        """Opens the trail, to report at once a file that cannot be read or is no trail."""
        self._connection(self._state())

    def select(self, sql: str, params: list[object]) -> list[AuditRecord]:
        """The records ``sql`` (a :func:`select_sql` statement) selects."""
        for _ in range(_READ_ATTEMPTS):
            state = self._state()
            db = self._connection(state)
            records = _select(db, sql.replace(f"SELECT {', '.join(FIELDS)} ",
                                              f"SELECT {self._columns} ", 1), params)
            if state[0] == "open" or self._state() == state:
                return records
            self.close()  # written while read at rest: what was read may be torn
        raise sqlite3.OperationalError(
            f"{self._path} changed under each of {_READ_ATTEMPTS} reads; try again")

    def close(self) -> None:
        """Closes the connection (a next read opens one again)."""
        if self._db is not None:
            self._db.close()
            self._db = None
            self._opened_for = ()


class _StoreThread:
    """The thread that owns the store's connection and runs functions for the event loop.

    Leaner than a one-worker ``ThreadPoolExecutor`` driven by ``run_in_executor`` (no
    concurrent future, condition or wrapped future in between), which matters because a
    hop may be paid on every audited call.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="audit-sqlite", daemon=True)
        self._thread.start()

    async def run(self, function: Callable[..., _T], *args: object) -> _T:
        """Runs ``function(*args)`` on the thread and returns what it returned (or raises
        what it raised)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[_T] = loop.create_future()
        self._jobs.put((loop, future, function, args))
        return await future

    def submit(self, function: Callable[..., object], *args: object) -> None:
        """Runs ``function(*args)`` on the thread without waiting for it; a failure is
        logged."""
        self._jobs.put((None, None, function, args))

    def stop(self) -> None:
        """Lets the thread finish the functions already handed over, then ends it."""
        self._jobs.put(None)
        self._thread.join()

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            loop, future, function, args = job
            try:
                outcome: tuple[object, BaseException | None] = (function(*args), None)
            except BaseException as exc:  # handed to the awaiting coroutine
                outcome = (None, exc)
            if loop is None:  # nobody waits for it
                if outcome[1] is not None:
                    log.warning("audit_store_job_failed", job=getattr(function, "__name__", "?"),
                                error=repr(outcome[1]))
                continue
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
                loop.call_soon_threadsafe(_settle, future, *outcome)


def _settle(future: asyncio.Future[Any], result: object, error: BaseException | None) -> None:
    if future.done():  # the caller was cancelled
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def make_private_file(path: Path) -> None:
    """Creates ``path`` readable and writable by this user only (0600), and the folders
    above it that do not exist yet 0700; an existing file open to others is narrowed to
    0600.

    SQLite gives the ``-wal`` and ``-shm`` files it makes beside a database the database
    file's mode, so they are 0600 too. The trail holds who called what, with what (even
    redacted): no other user of the machine should read it.
    """
    make_private_folders(path.parent)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        mode = os.fstat(fd).st_mode & 0o777
        if mode & 0o077 and os.fstat(fd).st_uid == os.geteuid():
            os.fchmod(fd, mode & 0o700)
            log.warning("audit_store_mode_narrowed", path=str(path),
                        mode=f"{mode:o}", now=f"{mode & 0o700:o}")
    finally:
        os.close(fd)
    for suffix in ("-wal", "-shm"):  # left by an older version beside the database
        companion = Path(f"{path}{suffix}")
        with contextlib.suppress(FileNotFoundError):
            if companion.stat().st_mode & 0o077 and companion.stat().st_uid == os.geteuid():
                companion.chmod(companion.stat().st_mode & 0o700)


# -- run on the store's thread -------------------------------------------------------------

def _connect(path: str) -> sqlite3.Connection:
    # isolation_level=None: transactions are spelled out (BEGIN IMMEDIATE … COMMIT).
    # timeout: how long to wait for a lock another connection (or process) holds.
    db = sqlite3.connect(path, isolation_level=None, timeout=BUSY_TIMEOUT_SECONDS)
    try:
        _enter_wal(db)
        db.execute("PRAGMA synchronous=NORMAL")
        _limit_wal_file(db)
        db.execute("BEGIN IMMEDIATE")  # two processes opening an older file: one adds
        try:
            for statement in _SCHEMA:
                db.execute(statement)
            columns = {row[1] for row in db.execute(f"PRAGMA table_info({TABLE})")}
            for name, sql_type in ADDED_COLUMNS.items():
                if name not in columns:
                    db.execute(f"ALTER TABLE {TABLE} ADD COLUMN {name} {sql_type}")
            db.execute("COMMIT")
        except BaseException:
            _roll_back(db)
            raise
    except BaseException:
        db.close()
        raise
    return db


def _enter_wal(db: sqlite3.Connection) -> None:
    """Switches the file to WAL mode. SQLite refuses the switch at once, without waiting,
    while another connection is opening the same file; on this thread a short retry is
    harmless."""
    for attempt in range(100):
        try:
            db.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if getattr(exc, "sqlite_errorcode", None) != sqlite3.SQLITE_BUSY or attempt == 99:
                raise
            time.sleep(0.02)


def _connect_fast(path: str) -> sqlite3.Connection:
    """The event loop's connection: it never waits for a lock and never checkpoints, so an
    append on it cannot block the loop for long (the thread's connection does both)."""
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute("PRAGMA busy_timeout=0")
        db.execute("PRAGMA wal_autocheckpoint=0")
        _limit_wal_file(db)
    except BaseException:
        db.close()
        raise
    return db


def _checkpoint_passive(db: sqlite3.Connection) -> int:
    """Copies the WAL into the database as far as no one is in the way; returns the WAL's
    length in frames when it started."""
    # PASSIVE neither waits for nor blocks the event loop's appends, and when no append
    # lands while it runs it completes and the next append starts the WAL from the top.
    # Under appends without pause it never completes.
    _, log_frames, _ = db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
    return int(log_frames)


def _restart_wal(db: sqlite3.Connection) -> None:
    """Copies the whole WAL into the database so that the next commit writes the WAL from
    its start, holding the write lock while it does (appends queue behind it on this
    thread: a pause, not a loss) — waiting at most :data:`RESTART_WAIT_SECONDS` for readers
    still on older snapshots to let go."""
    # RESTART rather than TRUNCATE: a WAL truncated to nothing grows again frame by frame,
    # and appending to a file costs the file system more than overwriting it, on every
    # append on the loop (measured in bench/README.md).
    db.execute(f"PRAGMA busy_timeout={int(RESTART_WAIT_SECONDS * 1000)}")
    try:
        # Busy (a reader kept its snapshot): as far as a passive checkpoint gets, no restart.
        db.execute("PRAGMA wal_checkpoint(RESTART)").fetchall()
    finally:
        db.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_SECONDS * 1000)}")


def _limit_wal_file(db: sqlite3.Connection) -> None:
    # A WAL file is reused from its start, not shrunk, when the log starts over: without a
    # limit it keeps the size of its longest run between two checkpoints.
    page_size = db.execute("PRAGMA page_size").fetchone()[0]
    db.execute(f"PRAGMA journal_size_limit={int(WAL_FRAMES_LIMIT * page_size)}")


def _append(db: sqlite3.Connection, records: Sequence[AuditRecord],
            key: ChainKey | None = None) -> list[AuditRecord]:
    """Numbers, chains (keyed with ``key``) and inserts ``records`` in one exclusive
    transaction."""
    db.execute("BEGIN IMMEDIATE")
    try:
        # Read under the write lock: another process may have appended since our last batch.
        last = db.execute(_HEAD).fetchone()
        sealed = seal(records, last[0] if last else 0, last[1] if last else GENESIS_HASH, key)
        if len(sealed) == 1:  # the common case: execute() skips executemany's iterator
            db.execute(_INSERT, _row(sealed[0]))
        else:
            db.executemany(_INSERT, [_row(record) for record in sealed])
        db.execute("COMMIT")
    except BaseException:
        _roll_back(db)
        raise
    return sealed


def _roll_back(db: sqlite3.Connection) -> None:
    """Ends a transaction that failed, leaving the failure's own error to be raised.

    After some errors — a full disk (``SQLITE_FULL``), an I/O error, running out of memory —
    SQLite has already rolled the transaction back itself, and a ROLLBACK would only fail
    with "no transaction is active": raised instead of the real error, that hid why the
    append failed.
    """
    if not db.in_transaction:
        return
    try:
        db.execute("ROLLBACK")
    except sqlite3.Error as exc:  # the first error is the one to report
        log.warning("audit_rollback_failed", error=str(exc))


def _select(db: sqlite3.Connection, sql: str, params: list[object]) -> list[AuditRecord]:
    cursor = db.execute(sql, params)
    names = [column[0] for column in cursor.description]
    return [AuditRecord.from_dict(dict(zip(names, row, strict=True)))
            for row in cursor.fetchall()]


def _row(record: AuditRecord) -> tuple[object, ...]:
    # One attrgetter call: dataclasses.astuple deep-copies every value, which costs more.
    values = list(_FIELD_VALUES(record))
    values[_PRIVILEGED] = int(values[_PRIVILEGED])  # SQLite has no boolean
    return tuple(values)


_FIELD_VALUES = operator.attrgetter(*FIELDS)
_PRIVILEGED = FIELDS.index("privileged")
