"""The hash chain that makes the audit trail tamper-evident, and its anchors.

Each record's ``hash`` is computed over its canonical JSON (every field but ``hash``,
including ``seq``, ``prev_hash`` and ``key_id``; empty text fields left out), and
``prev_hash`` is the hash of the record before it. With an audit key
(:mod:`~stargrpc.audit.key`) the hash is HMAC-SHA-256 with that key and the record names
the key in ``key_id``; records written without a key (by versions before keys) carry a
plain SHA-256 and no ``key_id``.

Changing a record breaks its own hash; deleting or reordering records breaks the ``seq``
sequence or the link to the previous hash. Re-computing the hashes after a change takes
the key. Cutting records off the *end*, or replacing the whole trail, leaves an intact
chain: an :class:`Anchor` (a record's seq and hash, kept elsewhere) catches that, and any
rewriting of the records up to it, key or no key.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import math
import operator
from collections.abc import AsyncIterable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from stargrpc.audit.key import ChainKey
from stargrpc.audit.record import FIELDS, GENESIS_HASH, AuditRecord


def record_hash(record: AuditRecord, key: ChainKey | None = None) -> str:
    """The hash ``record`` must carry, given its fields and ``prev_hash``.

    Args:
        record: The record.
        key: The key named by its ``key_id`` (None for an unkeyed record).

    Empty text fields are left out of the hashed content, so that a text column added in a
    later version (empty in older rows) leaves the hashes of older records valid.
    """
    return _hash_of(record, record.seq, record.prev_hash, record.key_id, key)


def _hash_of(record: AuditRecord, seq: int, prev_hash: str, key_id: str,
             key: ChainKey | None) -> str:
    """The hash of ``record`` as it would be with ``seq``, ``prev_hash`` and ``key_id``."""
    # This runs for every record written, on the server's event loop or the store's thread:
    # the fields are read in one go, already in the canonical (sorted) order, so the encoder
    # need not sort them — the same bytes as sort_keys=True.
    values = list(_SORTED_VALUES(record))
    values[_SEQ] = seq
    values[_PREV_HASH] = prev_hash
    values[_KEY_ID] = key_id
    canonical = _canonical_json(values).encode("utf-8")
    if key is None:
        return hashlib.sha256(canonical).hexdigest()
    keyed = _keyed(key.secret).copy()  # the key's HMAC state made once, copied per record
    keyed.update(canonical)
    return keyed.hexdigest()


def _canonical_json(values: Sequence[Any]) -> str:
    """What ``_CANONICAL`` makes of the hashed fields with these values (in
    :data:`_SORTED`'s order), empty text left out — the same text, written here field by
    field for the types a record holds (anything else goes to the encoder itself)."""
    parts = []
    for prefix, value in zip(_PREFIXES, values, strict=True):
        kind = type(value)
        if kind is str:
            if value:
                parts.append(prefix + _STRING(value))
        elif kind is bool:
            parts.append(prefix + ("true" if value else "false"))
        elif kind is int:
            parts.append(prefix + int.__repr__(value))
        elif kind is float and math.isfinite(value):
            parts.append(prefix + float.__repr__(value))
        elif value != "":
            parts.append(prefix + _CANONICAL.encode(value))
    return "{" + ",".join(parts) + "}"


@functools.lru_cache(maxsize=16)
def _keyed(secret: bytes) -> hmac.HMAC:
    return hmac.new(secret, digestmod=hashlib.sha256)


#: The fields a record's hash covers (all but ``hash``).
_HASHED = tuple(name for name in FIELDS if name != "hash")

#: The hashed fields in the canonical JSON's order (sorted), and how to read them.
_SORTED = tuple(sorted(_HASHED))
_SORTED_VALUES = operator.attrgetter(*_SORTED)
_SEQ, _PREV_HASH, _KEY_ID = (_SORTED.index(name) for name in ("seq", "prev_hash", "key_id"))

#: Keys come in sorted order already (_SORTED): the output is that of sort_keys=True.
_CANONICAL = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))

#: Each hashed field's key as the canonical JSON writes it, and how it writes a string
#: (the encoder's own function for ``ensure_ascii=False``).
_PREFIXES = tuple(_CANONICAL.encode(name) + ":" for name in _SORTED)
_STRING = json.encoder.encode_basestring


def seal(records: Iterable[AuditRecord], last_seq: int, last_hash: str,
         key: ChainKey | None = None) -> list[AuditRecord]:
    """``records`` numbered after ``last_seq`` and chained after ``last_hash``, keyed with
    ``key`` when there is one."""
    key_id = key.id if key is not None else ""
    sealed = []
    for record in records:
        last_seq += 1
        digest = _hash_of(record, last_seq, last_hash, key_id, key)
        sealed.append(_with_place(record, last_seq, last_hash, key_id, digest))
        last_hash = digest
    return sealed


def _with_place(record: AuditRecord, seq: int, prev_hash: str, key_id: str,
                digest: str) -> AuditRecord:
    """``record`` with its place in the chain: what ``dataclasses.replace`` gives, without
    running ``__init__`` over every field again (this runs for every record written)."""
    placed: AuditRecord = object.__new__(AuditRecord)
    placed.__dict__.update(record.__dict__, seq=seq, prev_hash=prev_hash, key_id=key_id,
                           hash=digest)
    return placed


@dataclass(frozen=True)
class Anchor:
    """A point of the chain kept outside the store: the trail must still have a record at
    ``count`` (its seq) whose hash is ``head_hash``.

    Attributes:
        head_hash: The hash of record ``count`` (:data:`GENESIS_HASH` for an empty trail).
        count: How many records the trail had.
    """

    head_hash: str
    count: int

    def __str__(self) -> str:
        return f"{self.head_hash}:{self.count}"

    @classmethod
    def parse(cls, text: str) -> Anchor:
        """An anchor from its text, ``HASH:COUNT``.

        Raises:
            ValueError: Not an anchor.
        """
        head_hash, _, count = text.strip().partition(":")
        if len(head_hash) != 64 or not count.isdigit() \
                or any(c not in "0123456789abcdef" for c in head_hash):
            raise ValueError(f"not an anchor (HASH:COUNT, as `stargrpc audit anchor` "
                             f"prints it): {text.strip()[:80]!r}")
        return cls(head_hash, int(count))


@dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify` found.

    Attributes:
        checked: How many records were checked.
        head_hash: The hash of the last good record.
        bad_seq: The first record that does not fit the chain (None when intact).
        bad_id: Its record id.
        reason: Why it does not fit.
        keyed: How many of the records checked are keyed (checked with their key).
        unkeyed: How many are unkeyed (written before the trail had a key; their hashes
            prove nothing against someone who could write the database).
        anchors: How many anchors were met.
    """

    checked: int
    head_hash: str
    bad_seq: int | None = None
    bad_id: str = ""
    reason: str = ""
    keyed: int = 0
    unkeyed: int = 0
    anchors: int = 0

    @property
    def intact(self) -> bool:
        """Whether every record fits the chain (and every anchor is met)."""
        return self.bad_seq is None and not self.reason


async def verify(records: AsyncIterable[AuditRecord], keys: Sequence[ChainKey] = (),
                 anchors: Sequence[Anchor] = (), *, require_key: bool = False
                 ) -> VerifyReport:
    """Checks records, in ``seq`` order, against the chain; stops at the first bad one.

    Args:
        records: The trail, in ``seq`` order.
        keys: The audit keys the records may name (a keyed record whose key is not
            given cannot be checked, and fails).
        anchors: Points the trail must still pass through.
        require_key: Fail on unkeyed records too. Without it, unkeyed records are accepted
            before the first keyed one (a trail written before it had a key) and counted
            in :attr:`VerifyReport.unkeyed`; an unkeyed record after a keyed one always
            fails.
    """
    by_id = {key.id: key for key in keys}
    expected = {anchor.count: anchor.head_hash for anchor in anchors}
    met = 0
    if expected.get(0, GENESIS_HASH) != GENESIS_HASH:
        return VerifyReport(0, GENESIS_HASH, reason="an anchor at 0 records must name the "
                            "genesis hash")
    met += 0 in expected
    expected_seq = 1
    previous = GENESIS_HASH
    keyed = unkeyed = 0
    async for record in records:
        reason = ""
        key = by_id.get(record.key_id)
        if record.seq != expected_seq:
            what = "missing" if record.seq > expected_seq else "out of order"
            reason = f"expected seq {expected_seq} here ({what} record)"
        elif record.prev_hash != previous:
            reason = "prev_hash does not match the record before it " \
                "(a record before it was deleted, changed or moved)"
        elif record.key_id and key is None:
            reason = f"it is keyed with audit key {record.key_id}, which was not given " \
                "(--key-file)"
        elif not record.key_id and (keyed or require_key):
            reason = "it is not keyed, after keyed records (it was rewritten without the " \
                "key)" if keyed else "it is not keyed (--require-key)"
        elif record_hash(record, key) != record.hash:
            reason = "its content does not match its hash (the record was changed)"
        elif expected.get(record.seq, record.hash) != record.hash:
            reason = "its hash is not the anchor's (this record or one before it was " \
                "rewritten)"
        if reason:
            return VerifyReport(expected_seq - 1, previous, record.seq, record.id,
                                reason, keyed, unkeyed, met)
        met += record.seq in expected
        if record.key_id:
            keyed += 1
        else:
            unkeyed += 1
        previous = record.hash
        expected_seq += 1
    checked = expected_seq - 1
    beyond = [count for count in expected if count > checked]
    if beyond:
        return VerifyReport(checked, previous, None, "",
                            f"the trail ends at seq {checked}, before the anchor at seq "
                            f"{min(beyond)} (records were cut off its end, or the trail "
                            "was replaced)", keyed, unkeyed, met)
    return VerifyReport(checked, previous, keyed=keyed, unkeyed=unkeyed, anchors=met)
