"""The hash chain that makes the audit trail tamper-evident.

Each record's ``hash`` is SHA-256 over its canonical JSON (every field but ``hash``,
including ``seq`` and ``prev_hash``; empty text fields left out), and ``prev_hash`` is the
hash of the record before it. Changing a record breaks its own hash; deleting or reordering
records breaks the ``seq`` sequence or the link to the previous hash. (Cutting records off
the *end* leaves a shorter, intact chain: compare the head hash with one kept elsewhere to
catch that.)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterable, Iterable
from dataclasses import dataclass

from stargrpc.audit.record import FIELDS, GENESIS_HASH, AuditRecord


def record_hash(record: AuditRecord) -> str:
    """The hash ``record`` must carry, given its fields and ``prev_hash``.

    Empty text fields are left out of the hashed content, so that a text column added in a
    later version (empty in older rows) leaves the hashes of older records valid.
    """
    return _hash_of(record, record.seq, record.prev_hash)


def _hash_of(record: AuditRecord, seq: int, prev_hash: str) -> str:
    """The hash of ``record`` as it would be with ``seq`` and ``prev_hash``."""
    # Field by field rather than through dataclasses.asdict (a deep copy of every value):
    # this runs for every record written, on the server's event loop or the store's thread.
    content = {name: getattr(record, name) for name in _HASHED}
    content["seq"] = seq
    content["prev_hash"] = prev_hash
    canonical = _CANONICAL.encode({name: value for name, value in content.items()
                                   if value != ""})
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


#: The fields a record's hash covers (all but ``hash``).
_HASHED = tuple(name for name in FIELDS if name != "hash")

_CANONICAL = json.JSONEncoder(sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def seal(records: Iterable[AuditRecord], last_seq: int, last_hash: str) -> list[AuditRecord]:
    """``records`` numbered after ``last_seq`` and chained after ``last_hash``."""
    sealed = []
    for record in records:
        last_seq += 1
        digest = _hash_of(record, last_seq, last_hash)
        sealed.append(_with_place(record, last_seq, last_hash, digest))
        last_hash = digest
    return sealed


def _with_place(record: AuditRecord, seq: int, prev_hash: str, digest: str) -> AuditRecord:
    """``record`` with its place in the chain: what ``dataclasses.replace`` gives, without
    running ``__init__`` over every field again (this runs for every record written)."""
    placed: AuditRecord = object.__new__(AuditRecord)
    placed.__dict__.update(record.__dict__, seq=seq, prev_hash=prev_hash, hash=digest)
    return placed


@dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify` found.

    Attributes:
        checked: How many records were checked.
        head_hash: The hash of the last good record.
        bad_seq: The first record that does not fit the chain (None when intact).
        bad_id: Its record id.
        reason: Why it does not fit.
    """

    checked: int
    head_hash: str
    bad_seq: int | None = None
    bad_id: str = ""
    reason: str = ""

    @property
    def intact(self) -> bool:
        """Whether every record fits the chain."""
        return self.bad_seq is None


async def verify(records: AsyncIterable[AuditRecord]) -> VerifyReport:
    """Checks records, in ``seq`` order, against the chain; stops at the first bad one."""
    expected_seq = 1
    previous = GENESIS_HASH
    checked = 0
    async for record in records:
        reason = ""
        if record.seq != expected_seq:
            what = "missing" if record.seq > expected_seq else "out of order"
            reason = f"expected seq {expected_seq} here ({what} record)"
        elif record.prev_hash != previous:
            reason = "prev_hash does not match the record before it " \
                "(a record before it was deleted, changed or moved)"
        elif record_hash(record) != record.hash:
            reason = "its content does not match its hash (the record was changed)"
        if reason:
            return VerifyReport(checked, previous, record.seq, record.id, reason)
        previous = record.hash
        expected_seq += 1
        checked += 1
    return VerifyReport(checked, previous)
