"""The SQL both audit stores share: the table, its schema, the query a :class:`Query` means.

The SQLite and PostgreSQL stores build on this module; :mod:`stargrpc.audit.store` (the
protocol and :func:`~stargrpc.audit.store.open_store`) builds on them, so the way goes one
way: store → sqlite/postgres → sql.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from stargrpc.audit.record import FIELDS, AuditRecord


@dataclass(frozen=True)
class Query:
    """Which records to read.

    Attributes:
        tool: Only this tool.
        principal: Only calls by this principal, or made on behalf of this end user.
        outcome: Only this outcome.
        method: Only this gRPC method: its full name or its last part ("Execute").
        since: Only records at or after this time (the store's ISO 8601 UTC format).
        root_run_id: Only the records of this call tree: of its root run and of the runs
            below it.
        after_seq: Only records after this seq.
        limit: At most this many (None: all).
        newest_first: Newest first instead of oldest first.
    """

    tool: str | None = None
    principal: str | None = None
    outcome: str | None = None
    method: str | None = None
    since: str | None = None
    root_run_id: str | None = None
    after_seq: int = 0
    limit: int | None = None
    newest_first: bool = False


def sqlite_path(url: str) -> Path:
    """The file a SQLite URL names, as SQLAlchemy reads it: ``sqlite:///audit.db`` is
    relative to the working directory, ``sqlite:////var/lib/stargrpc/audit.db`` absolute.

    Raises:
        ValueError: The URL names no file.
    """
    rest = url.split("://", 1)[1].removeprefix("/")
    if not rest:
        raise ValueError("the sqlite audit store URL names no file: use sqlite:///PATH")
    return Path(rest)


#: The table both stores keep records in.
TABLE = "audit_records"


#: Columns added after the first version, with their SQL type: a table an older version
#: made gains them when a store opens it (empty in older rows, which leaves their hashes
#: valid: empty text is not hashed).
ADDED_COLUMNS = {"key_id": "TEXT NOT NULL DEFAULT ''", "usage": "TEXT NOT NULL DEFAULT ''",
                 "parent_run_id": "TEXT NOT NULL DEFAULT ''",
                 "root_run_id": "TEXT NOT NULL DEFAULT ''"}


#: Columns a store may index for ``stargrpc audit query`` (each index costs every append).
INDEXABLE = ("time", "tool", "principal", "run_id")


def schema_sql(column_types: dict[str, str], indexed: tuple[str, ...] = INDEXABLE
               ) -> list[str]:
    """CREATE statements of the table and its indexes.

    Args:
        column_types: SQL types of the columns that are not plain required text.
        indexed: The columns to index (of :data:`INDEXABLE`); the others are dropped.
    """
    columns = ", ".join(f"{name} {column_types.get(name, 'TEXT NOT NULL')}" for name in FIELDS)
    return [f"CREATE TABLE IF NOT EXISTS {TABLE} ({columns})",
            *(f"CREATE INDEX IF NOT EXISTS {TABLE}_{column} ON {TABLE} ({column})"
              for column in indexed),
            *(f"DROP INDEX IF EXISTS {TABLE}_{column}"
              for column in INDEXABLE if column not in indexed)]


def select_sql(table: str, query: Query, placeholder: str) -> tuple[str, list[object]]:
    """The SELECT statement for ``query`` and its parameters.

    Args:
        table: The table name (trusted, never from a request).
        query: What to select.
        placeholder: "?" for SQLite, "$" for PostgreSQL (numbered ``$1``, ``$2``, …).
    """
    params: list[object] = []

    def param(value: object) -> str:
        params.append(value)
        return "?" if placeholder == "?" else f"${len(params)}"

    conditions = [f"seq > {param(query.after_seq)}"]
    if query.tool:
        conditions.append(f"tool = {param(query.tool)}")
    if query.principal:
        conditions.append(f"(principal = {param(query.principal)} "
                          f"OR acting_for = {param(query.principal)})")
    if query.outcome:
        conditions.append(f"outcome = {param(query.outcome)}")
    if query.method:
        conditions.append(f"(method = {param(query.method)} "
                          f"OR method LIKE {param('%/' + query.method)})")
    if query.since:
        conditions.append(f"time >= {param(query.since)}")
    if query.root_run_id:
        conditions.append(f"(root_run_id = {param(query.root_run_id)} "
                          f"OR run_id = {param(query.root_run_id)})")
    sql = (f"SELECT {', '.join(FIELDS)} FROM {table} WHERE {' AND '.join(conditions)} "
           f"ORDER BY seq {'DESC' if query.newest_first else 'ASC'}")
    if query.limit is not None:
        sql += f" LIMIT {param(query.limit)}"
    return sql, params


async def scan_in_batches(query: Callable[[Query], Awaitable[list[AuditRecord]]],
                          batch: int) -> AsyncIterator[AuditRecord]:
    """Every record in seq order, ``batch`` at a time, through a store's ``query``."""
    after = 0
    while True:
        records = await query(Query(after_seq=after, limit=batch))
        for record in records:
            yield record
        if len(records) < batch:
            return
        after = records[-1].seq
