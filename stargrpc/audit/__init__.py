"""The audit trail: one tamper-evident record per call attempt.

- :mod:`~stargrpc.audit.record` — the record and the names of outcomes;
- :mod:`~stargrpc.audit.redact` — secret-looking keys redacted, long values cut;
- :mod:`~stargrpc.audit.key` — the audit key the chain is keyed with (HMAC);
- :mod:`~stargrpc.audit.chain` — the hash chain, its verification and its anchors;
- :mod:`~stargrpc.audit.store` — the store protocol and :func:`open_store` (SQLite by
  default, PostgreSQL for a fleet);
- :mod:`~stargrpc.audit.sql` — the table and queries the two stores share;
- :mod:`~stargrpc.audit.writer` — the writer: group commit, retries, the bounded wait.

The interceptor that produces the records is :mod:`stargrpc.server.interceptors.audit`; the
``stargrpc audit`` commands that read them are in :mod:`stargrpc.cli.audit`.
"""

from __future__ import annotations

from stargrpc.audit.chain import Anchor, VerifyReport, verify
from stargrpc.audit.key import AuditKeyError, ChainKey, load_key, load_or_create_key
from stargrpc.audit.record import OUTCOMES, AuditRecord
from stargrpc.audit.redact import REDACTED, RedactionLimits, redact, redacted_json
from stargrpc.audit.store import AuditStore, Query, default_store_url, open_store
from stargrpc.audit.writer import AuditWriter

__all__ = [
    "OUTCOMES",
    "REDACTED",
    "Anchor",
    "AuditKeyError",
    "AuditRecord",
    "AuditStore",
    "AuditWriter",
    "ChainKey",
    "Query",
    "RedactionLimits",
    "VerifyReport",
    "default_store_url",
    "load_key",
    "load_or_create_key",
    "open_store",
    "redact",
    "redacted_json",
    "verify",
]
