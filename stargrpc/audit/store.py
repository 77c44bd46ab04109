"""Where audit records are kept: the :class:`AuditStore` protocol and :func:`open_store`.

One setting picks the store: ``sqlite:///PATH`` (the default, under the state directory)
or ``postgresql://…`` (for a fleet of replicas sharing one trail). Either way the store
numbers and chains the records as it appends them, inside one transaction that excludes
other writers, so a trail written by several processes is still one chain.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol
from urllib.parse import urlsplit

from stargrpc.audit.key import ChainKey
from stargrpc.audit.record import AuditRecord
from stargrpc.audit.sql import TABLE, Query, sqlite_path

if TYPE_CHECKING:
    from stargrpc.settings import Settings

# Where callers have long found them; the SQL both stores share is in stargrpc.audit.sql.
__all__ = ["TABLE", "AuditStore", "Query", "default_store_url", "open_store", "sqlite_path"]


class AuditStore(Protocol):
    """A durable, append-only, hash-chained audit trail.

    A store may also offer ``refuses(exc) -> bool``: whether an error its ``append`` raised
    is about the records' content (trying them again fails again), which the audit writer
    then isolates and replaces (:mod:`stargrpc.audit.writer`); without it every failure
    counts as the store's, and is retried.
    """

    url: str

    async def open(self) -> None:
        """Connects and creates the table if needed."""
        ...

    async def append(self, records: Sequence[AuditRecord]) -> list[AuditRecord]:
        """Numbers, chains and writes ``records`` in one transaction.

        Returns:
            The records as stored (with seq, prev_hash and hash).
        """
        ...

    async def query(self, query: Query) -> list[AuditRecord]:
        """Records matching ``query``."""
        ...

    def scan(self, batch: int = 1000) -> AsyncIterator[AuditRecord]:
        """Every record in seq order, read in batches."""
        ...

    async def aclose(self) -> None:
        """Closes the connection."""
        ...


def default_store_url(state_dir: Path) -> str:
    """The store used when none is configured: SQLite under the state directory."""
    return f"sqlite:///{(state_dir / 'audit.db').as_posix()}"


def audit_store_url(settings: Settings) -> str:
    """The server's audit store: ``audit_store``, else the default one."""
    return settings.audit_store or default_store_url(settings.state_dir)


def open_store(url: str, key: ChainKey | None = None, *,
               sqlite_on_loop: bool = True) -> AuditStore:
    """The store a URL names (not yet opened).

    Args:
        url: ``sqlite:///relative/or//absolute/path.db`` or ``postgresql://user@host/db``
            (``postgres://`` too; extra query parameters such as ``search_path`` are passed
            to the server as settings).
        key: The audit key the records it appends are keyed with (None: unkeyed).
        sqlite_on_loop: A SQLite trail tries each append on the event loop first
            (``audit_sqlite_append_on_loop``).

    Raises:
        ValueError: The URL names no supported store.
    """
    scheme = urlsplit(url).scheme.lower()
    if scheme == "sqlite":
        from stargrpc.audit.sqlite import SqliteAuditStore

        return SqliteAuditStore(url, key, on_loop=sqlite_on_loop)
    if scheme in ("postgresql", "postgres"):
        from stargrpc.audit.postgres import PostgresAuditStore

        return PostgresAuditStore(url, key)
    raise ValueError(f"unsupported audit store {url.split('://')[0]!r}: use sqlite:///PATH "
                     "or postgresql://…")
