"""The PostgreSQL audit store (asyncpg), for replicas that share one trail.

Every append holds a transaction-scoped advisory lock while it inserts, so writers of one
trail take turns. An append is one statement, so one round trip on a connection kept for
appends: the batch is sealed after the chain's head this store last wrote or read, and
inserted (from one array per column) only if that head is still the table's last record
(the ``seq`` primary key catches a head that moved after the statement's snapshot). When
the head has moved (another replica appended), the store does it the long way — in one
transaction: take the lock, read the head, insert — and remembers the new head. Either way
appends from any number of replicas form one gapless chain.

A batch may have landed without the store knowing: the link broke after the server committed
its INSERT and before the reply came, and the writer appends the same records again. The
retry's head is stale, so it takes the locked path, whose INSERT then collides on the
records' ids; only then (never on a normal append) does the store look the ids up, under the
lock, and return the records as the trail holds them — nothing inserted twice, the chain
untouched.

An append that gets no answer within the write timeout (connecting included) drops its
connection and is retried on a new one. Dropping only closes this end, though: over a
half-open link the server's session lives on, and one dropped inside the locked path's
transaction would keep the writers' lock — every replica's next locked append waiting
behind it — until the server's TCP keepalive notices (hours). So the append connection asks
the server to end such a session itself: ``idle_in_transaction_session_timeout`` is the
write timeout (no append of ours is idle in its transaction that long: the client gave it
up by then), and ``lock_timeout`` a tenth under it, so a wait for the lock fails cleanly
(the connection stays usable, the writer retries) before the append would be dropped, and a
dropped append's session does not queue for the lock after its client has gone.

Query parameters of the URL that asyncpg does not know (``?search_path=audit``) are sent to
the server as settings, which is how a deployment (or a test) picks the schema; they apply
together with the two above, and a URL that sets either of those itself has its way.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Sequence
from urllib.parse import parse_qs, urlsplit

import asyncpg
import structlog

from stargrpc.audit.chain import seal
from stargrpc.audit.key import ChainKey
from stargrpc.audit.record import FIELDS, GENESIS_HASH, AuditRecord
from stargrpc.audit.sql import (
    ADDED_COLUMNS,
    TABLE,
    Query,
    scan_in_batches,
    schema_sql,
    select_sql,
)

#: SQLSTATE classes that refuse an append for its records' content (see ``refuses``).
_REFUSED_CLASSES = ("22", "23", "54")

_TYPES = {"seq": "BIGINT PRIMARY KEY", "id": "TEXT NOT NULL UNIQUE",
          "duration_ms": "DOUBLE PRECISION NOT NULL", "privileged": "BOOLEAN NOT NULL"}

_SCHEMA = [*schema_sql(_TYPES),
           *(f"ALTER TABLE {TABLE} ADD COLUMN IF NOT EXISTS {name} {sql_type}"
             for name, sql_type in ADDED_COLUMNS.items())]

# One lock per schema-qualified table: writers of the same trail take turns.
_LOCK_CALL = f"pg_advisory_xact_lock(hashtext(current_schema() || '.{TABLE}'))"
_LOCK = f"SELECT {_LOCK_CALL}"

_HEAD = f"SELECT seq, hash FROM {TABLE} ORDER BY seq DESC LIMIT 1"

_BY_ID = f"SELECT {', '.join(FIELDS)} FROM {TABLE} WHERE id = ANY($1::text[])"

#: What a record's chain place is made of: the rest is what the caller wrote.
_PLACE = ("seq", "prev_hash", "hash", "key_id")

log = structlog.get_logger("stargrpc.audit")

#: How long one append (connecting included: one deadline for both) may take before its
#: connection is dropped. A link gone silent — a half-open TCP connection, a server that
#: stalls — would otherwise hold the append, and every record queued behind it, until TCP
#: itself gives up (many minutes). Dropping the connection fails whatever waits on it at
#: once; the writer retries on a new one, and a batch that committed unacknowledged is
#: recognised by its ids. The server ends a session left in its transaction this long (see
#: the module docstring).
WRITE_TIMEOUT_SECONDS = 30.0

#: The part of the write timeout a wait for the writers' lock may take (``lock_timeout``).
_LOCK_WAIT_SHARE = 0.9

#: How long closing waits for the append connection to say goodbye before dropping it.
_CLOSE_TIMEOUT_SECONDS = 5.0

_ARRAY_TYPES = {"seq": "bigint[]", "duration_ms": "float8[]", "privileged": "boolean[]"}

# The batch as one array per column, inserted under the writers' lock and only while the
# chain's last hash is still the one the batch was sealed after (the last parameter). The
# statement's snapshot may predate the lock; a head that moved meanwhile makes the insert
# collide on ``seq`` instead.
_INSERT = (
    f"INSERT INTO {TABLE} ({', '.join(FIELDS)}) "
    f"SELECT * FROM unnest("
    + ", ".join(f"${i}::{_ARRAY_TYPES.get(name, 'text[]')}"
                for i, name in enumerate(FIELDS, start=1))
    + f") WHERE (SELECT count(*) FROM (SELECT {_LOCK_CALL}) AS locked) = 1 "
    f"AND coalesce((SELECT hash FROM {TABLE} ORDER BY seq DESC LIMIT 1), "
    f"'{GENESIS_HASH}') = ${len(FIELDS) + 1}"
)


class PostgresAuditStore:
    """An audit trail in a PostgreSQL table.

    Attributes:
        url: ``postgresql://user[:password]@host[:port]/database[?search_path=schema]``.
        key: The audit key appended records are keyed with (None: unkeyed).
        write_timeout: Seconds one append may take (:data:`WRITE_TIMEOUT_SECONDS`).
    """

    url: str
    key: ChainKey | None
    write_timeout: float
    _pool: asyncpg.Pool | None
    _writer: asyncpg.Connection | None
    _head: tuple[int, str] | None

    def __init__(self, url: str, key: ChainKey | None = None, *,
                 write_timeout: float = WRITE_TIMEOUT_SECONDS) -> None:
        self.url = url
        self.key = key
        self.write_timeout = write_timeout
        self._pool = None
        self._writer = None
        self._head = None  # (seq, hash) of the last record this store wrote or read

    async def open(self) -> None:
        self._pool = await asyncpg.create_pool(self.url, min_size=1, max_size=4)
        async with self._pool.acquire() as conn, conn.transaction():
            await conn.execute(_LOCK)  # two replicas starting at once: one creates
            for statement in _SCHEMA:
                await conn.execute(statement)

    @property
    def _db(self) -> asyncpg.Pool:
        if self._pool is None:
            raise RuntimeError("the audit store is not open")
        return self._pool

    async def _writer_connection(self) -> asyncpg.Connection:
        # A connection of its own, outside the pool: a pool resets a connection (a round
        # trip) every time it is released, and takes back one it finds broken — after which
        # the writer could not even ask whether it is closed.
        if self._writer is not None and self._writer.is_closed():
            self._writer = None  # lost (the server restarted or the link broke): a new one
        if self._writer is None:
            self._writer = await asyncpg.connect(
                self.url, timeout=self.write_timeout,
                server_settings=_session_settings(self.url, self.write_timeout))
        return self._writer

    async def append(self, records: Sequence[AuditRecord]) -> list[AuditRecord]:
        """Appends ``records`` (see the module docstring).

        Raises:
            TimeoutError: The server did not answer within :attr:`write_timeout` (the
                connection is dropped: the next append makes a new one).
        """
        if not records:
            return []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.write_timeout  # one for connecting and appending
        timed_out = TimeoutError(f"the audit database did not answer within "
                                 f"{self.write_timeout:g} s")
        try:
            conn = await self._writer_connection()
        except TimeoutError as exc:  # asyncpg gave the connection attempt up itself
            raise timed_out from exc
        dropped: list[bool] = []

        def drop() -> None:
            dropped.append(True)
            conn.terminate()

        # Whatever connecting took is gone from the append's time (a deadline already
        # past drops the connection at once).
        watchdog = loop.call_at(deadline, drop)
        try:
            return await self._append_on(conn, records)
        except Exception as exc:
            if dropped:
                raise timed_out from exc
            raise
        finally:
            watchdog.cancel()

    @staticmethod
    def refuses(exc: BaseException) -> bool:
        """Whether ``exc``, raised by :meth:`append`, says the records themselves cannot be
        stored, so trying them again fails again: the server refused their data (SQLSTATE
        class 22), a constraint (23), or a limit such as an indexed text over a third of a
        page (54: ``index row size … exceeds btree version 4 maximum 2704``); or asyncpg
        could not encode a value (a ValueError: an integer no float holds). A lost or
        silent connection, a lock not granted in time and the like are the store's trouble
        and pass."""
        if isinstance(exc, asyncpg.PostgresError):
            return str(getattr(exc, "sqlstate", "") or "")[:2] in _REFUSED_CLASSES
        return isinstance(exc, (ValueError, TypeError, OverflowError))

    async def _append_on(self, conn: asyncpg.Connection, records: Sequence[AuditRecord]
                         ) -> list[AuditRecord]:
        if self._head is not None:
            sealed = seal(records, self._head[0], self._head[1], self.key)
            try:
                status = await conn.execute(_INSERT, *_columns(sealed), self._head[1])
            except asyncpg.UniqueViolationError:
                status = ""  # another writer took the next seq first
            if status == f"INSERT 0 {len(sealed)}":
                self._head = (sealed[-1].seq, sealed[-1].hash)
                return sealed
        try:
            return await self._append_locked(conn, records, look_up_ids=False)
        except asyncpg.UniqueViolationError:
            # Under the lock the head is the table's own, so only an id can collide: the
            # batch (or some of it) is in the trail already — a retry of an append whose
            # commit the store never heard of. Again, this time looking the ids up first.
            return await self._append_locked(conn, records, look_up_ids=True)

    async def _append_locked(self, conn: asyncpg.Connection, records: Sequence[AuditRecord],
                             *, look_up_ids: bool) -> list[AuditRecord]:
        """Appends ``records`` after the table's head, in one transaction holding the
        writers' lock. With ``look_up_ids``, those the trail holds already (by id) are not
        appended again but returned as stored."""
        async with conn.transaction():
            await conn.execute(_LOCK)
            landed = (_landed(records, await conn.fetch(_BY_ID, [r.id for r in records]))
                      if look_up_ids else {})
            last = await conn.fetchrow(_HEAD)
            head = (last["seq"], last["hash"]) if last else (0, GENESIS_HASH)
            sealed = seal([r for r in records if r.id not in landed], head[0], head[1],
                          self.key)
            if sealed:
                await conn.execute(_INSERT, *_columns(sealed), head[1])
        self._head = (sealed[-1].seq, sealed[-1].hash) if sealed else head
        if not landed:
            return sealed
        appended = iter(sealed)
        return [landed[r.id] if r.id in landed else next(appended) for r in records]

    async def query(self, query: Query) -> list[AuditRecord]:
        sql, params = select_sql(TABLE, query, "$")
        rows = await self._db.fetch(sql, *params)
        return [AuditRecord.from_dict(dict(row)) for row in rows]

    def scan(self, batch: int = 1000) -> AsyncIterator[AuditRecord]:
        return scan_in_batches(self.query, batch)

    async def aclose(self) -> None:
        if self._pool is not None:
            if self._writer is not None:
                writer, self._writer = self._writer, None
                # A silent link must not hold the server's shutdown: close() drops the
                # connection itself when its goodbye is not answered in time.
                with contextlib.suppress(Exception):
                    await writer.close(timeout=_CLOSE_TIMEOUT_SECONDS)
            pool, self._pool = self._pool, None
            # The pool drops its connections itself when closing them is cut short.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(pool.close(), _CLOSE_TIMEOUT_SECONDS)


def _session_settings(url: str, write_timeout: float) -> dict[str, str]:
    """The server settings of the append connection (see the module docstring), less those
    ``url`` sets itself: asyncpg sends the URL's unknown query parameters as settings too,
    and lets ``server_settings`` override them."""
    settings = {
        "idle_in_transaction_session_timeout": str(max(1, math.ceil(write_timeout * 1000))),
        "lock_timeout": str(max(1, math.floor(write_timeout * _LOCK_WAIT_SHARE * 1000))),
    }
    given = parse_qs(urlsplit(url).query, keep_blank_values=True)
    return {name: value for name, value in settings.items() if name not in given}


def _columns(records: Sequence[AuditRecord]) -> list[list[object]]:
    """``records`` as one list per column, in :data:`FIELDS` order."""
    return [[getattr(record, name) for record in records] for name in FIELDS]


def _landed(records: Sequence[AuditRecord], rows: Sequence[asyncpg.Record]
            ) -> dict[str, AuditRecord]:
    """The records of a batch the trail holds already (``rows``, found by their ids), by
    id, as stored.

    One INSERT commits a whole batch or none of it, so a retry finds all its records or
    none. Finding only some, or a record under one of the batch's ids that is not the one
    written, is not this store's doing (rows deleted or added behind its back, another
    writer reusing ids). It is logged as an error naming the ids, and the safe way on is
    taken: what is missing is appended after the head as usual and what is found is kept
    as stored (a record of other content under one of our ids cannot be written under
    it, and rewriting the trail is not the store's to do). Every id of the batch is then
    in the trail once, the chain unbroken, and the writer is not stuck retrying a batch it
    can never insert. A record of ours whose id the trail holds with other content is the
    one thing not stored: the stored record is returned in its place, and ours is in the
    error, whole (``not_stored``, as ``audit_record_not_stored`` logs a record) — logged,
    not silently dropped.
    """
    landed = {row["id"]: AuditRecord.from_dict(dict(row)) for row in rows}
    if not landed:
        return landed
    differ = [record for record in records
              if record.id in landed and _content(landed[record.id]) != _content(record)]
    if len(landed) < len(records) or differ:
        log.error("audit_batch_partly_in_trail", records=len(records), found=len(landed),
                  found_ids=sorted(landed), other_content_ids=[r.id for r in differ],
                  not_stored=[record.as_dict() for record in differ],
                  action="appending the records not found; keeping those found as stored"
                         + ("; the records under ids stored with other content are not "
                            "stored (not_stored)" if differ else ""))
    else:
        log.warning("audit_batch_already_in_trail", records=len(records),
                    first_seq=min(record.seq for record in landed.values()),
                    reason="a retried append whose earlier commit went unacknowledged")
    return landed


def _content(record: AuditRecord) -> dict[str, object]:
    """What the caller wrote of ``record``: every field but its place in the chain."""
    return {name: getattr(record, name) for name in FIELDS if name not in _PLACE}
