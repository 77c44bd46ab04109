"""Where approval requests and their decisions live: one record per run that waits for a
person (:class:`ApprovalRecord`), the protocol every store offers (:class:`ApprovalStore`)
and the embedded one (:class:`MemoryApprovalStore`).

A record is written by the replica that runs the run, when the run starts to wait; any
replica decides on it (ApproveRun lands wherever the balancer sends it), and the waiting run
learns of the decision through the store: at once in one process, within a poll interval
from Redis (:mod:`stargrpc.stores.redis.approvals`). A record leaves ``pending`` exactly
once — decided by an approver, timed out, or withdrawn because the run ended while it
waited — and every change is one atomic compare-and-set, so two approvers (or an approver
and the timeout) racing on one run see one winner and one APPROVAL_NOT_PENDING.

The approval id is compared by its SHA-256 (:func:`id_hash`), in constant time here and
as digests in Redis: the comparison tells nothing about the id's characters.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import hmac
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

#: The states of a record. Only ``pending`` changes, and only once.
PENDING = "pending"
APPROVED = "approved"
DENIED = "denied"
TIMED_OUT = "timed_out"
WITHDRAWN = "withdrawn"
STATES = (PENDING, APPROVED, DENIED, TIMED_OUT, WITHDRAWN)

#: What :meth:`ApprovalStore.decide` answers besides ``decided``.
MISSING = "missing"
NOT_PENDING = "not_pending"
ID_MISMATCH = "id_mismatch"
DIGEST_MISMATCH = "digest_mismatch"
DECIDED = "decided"


def id_hash(approval_id: str) -> str:
    """The SHA-256 (hex) an approval id is compared by."""
    return hashlib.sha256(approval_id.encode("utf-8", "surrogatepass")).hexdigest()


async def wait_set(event: asyncio.Event, within: float) -> None:
    """Waits until ``event`` is set, at most ``within`` seconds."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(max(0.0, within)):
            await event.wait()


def now_ms() -> int:
    """This host's time in ms since the epoch."""
    return time.time_ns() // 1_000_000


@dataclass(frozen=True)
class ApprovalRecord:
    """One run's approval request and, once taken, its decision.

    Attributes:
        run_id: The run that waits.
        approval_id: The id an approver decides with (random; shown to those who may see
            the run, never derived from it).
        tool: The tool the run would run.
        owner: The id of the principal that started the run.
        principal: Who started it as shown ("alice acting for bob").
        digest: Hex SHA-256 of the canonical JSON of the run's arguments.
        arguments: The arguments as the audit shows them (redacted JSON).
        requested_ms: When the run started to wait (ms since the epoch).
        deadline_ms: When it stops waiting (ends APPROVAL_TIMEOUT) unless decided.
        state: One of :data:`STATES`.
        approver: Who decided (the principal's id); empty until decided.
        reason: The approver's reason (or why it was withdrawn).
        decided_ms: When it left ``pending``; 0 until then.
    """

    run_id: str
    approval_id: str
    tool: str
    owner: str
    principal: str
    digest: str
    arguments: str
    requested_ms: int
    deadline_ms: int
    state: str = PENDING
    approver: str = ""
    reason: str = ""
    decided_ms: int = 0

    @property
    def pending(self) -> bool:
        """Whether it still waits for a decision."""
        return self.state == PENDING

    def as_fields(self) -> dict[str, str]:
        """Every field as text (a Redis hash), plus the approval id's hash."""
        fields = {name: str(value) for name, value in dataclasses.asdict(self).items()}
        fields["id_hash"] = id_hash(self.approval_id)
        return fields

    @classmethod
    def from_fields(cls, fields: dict[str, str]) -> ApprovalRecord:
        """The record :meth:`as_fields` wrote.

        Raises:
            KeyError, ValueError: The fields are not a record's.
        """
        values: dict[str, object] = {}
        for item in dataclasses.fields(cls):
            text = fields.get(item.name)
            if text is None:
                if item.default is dataclasses.MISSING:
                    raise KeyError(item.name)
                continue
            values[item.name] = int(text) if item.type == "int" else text
        return cls(**values)  # type: ignore[arg-type]


class ApprovalStore(Protocol):
    """Approval records shared by every replica that shares the run store."""

    async def put(self, record: ApprovalRecord, ttl_ms: int) -> None:
        """Stores a new pending record; it expires ``ttl_ms`` after this.

        Raises:
            Unavailable: A shared store is unreachable.
        """
        ...

    async def get(self, run_id: str) -> ApprovalRecord | None:
        """The record of ``run_id``, or None (never waited, or expired).

        Raises:
            Unavailable: A shared store is unreachable.
        """
        ...

    async def get_many(self, run_ids: list[str]) -> dict[str, ApprovalRecord]:
        """The records of those of ``run_ids`` that have one (one round trip).

        Raises:
            Unavailable: A shared store is unreachable.
        """
        ...

    async def decide(self, run_id: str, approval_id: str, digest: str, state: str,
                     approver: str, reason: str) -> tuple[str, ApprovalRecord | None]:
        """Moves a pending record to ``state`` (approved or denied) when ``approval_id``
        is its id and ``digest`` (unless empty) its digest, atomically.

        Returns:
            :data:`DECIDED` and the decided record; else :data:`MISSING` (no record),
            :data:`NOT_PENDING`, :data:`ID_MISMATCH` or :data:`DIGEST_MISMATCH` with the
            record as it stands.

        Raises:
            Unavailable: A shared store is unreachable.
        """
        ...

    async def settle(self, run_id: str, state: str, reason: str) -> ApprovalRecord | None:
        """Moves a pending record to ``state`` (timed out or withdrawn), atomically; a
        record already decided stays as it is.

        Returns:
            The record as it stands after (None when it is gone).

        Raises:
            Unavailable: A shared store is unreachable.
        """
        ...

    async def wait(self, run_id: str, within: float) -> ApprovalRecord | None:
        """Waits up to ``within`` seconds for the pending record of ``run_id`` to leave
        ``pending`` (to be decided on any replica).

        Returns:
            The record as it stands at the end (still pending at the timeout).

        Raises:
            Unavailable: A shared store is unreachable.
        """
        ...

    async def aclose(self) -> None:
        """Stops what the store runs in the background."""
        ...


class MemoryApprovalStore:
    """Approval records in this process (the embedded server's store).

    Records are kept until they expire (``ttl_ms`` from :meth:`put`); expired ones are
    dropped as new ones come, oldest first.
    """

    def __init__(self) -> None:
        self._records: OrderedDict[str, tuple[ApprovalRecord, float]] = OrderedDict()
        self._changed: dict[str, asyncio.Event] = {}

    def _drop_expired(self) -> None:
        now = time.monotonic()
        while self._records:
            _, expires = next(iter(self._records.values()))
            if expires > now:
                break
            self._records.popitem(last=False)

    def _live(self, run_id: str) -> ApprovalRecord | None:
        held = self._records.get(run_id)
        if held is None:
            return None
        if held[1] <= time.monotonic():
            del self._records[run_id]
            return None
        return held[0]

    def _replace(self, record: ApprovalRecord) -> None:
        self._records[record.run_id] = (record, self._records[record.run_id][1])
        event = self._changed.get(record.run_id)
        if event is not None:
            event.set()

    async def put(self, record: ApprovalRecord, ttl_ms: int) -> None:
        self._drop_expired()
        self._records[record.run_id] = (record, time.monotonic() + ttl_ms / 1000)

    async def get(self, run_id: str) -> ApprovalRecord | None:
        return self._live(run_id)

    async def get_many(self, run_ids: list[str]) -> dict[str, ApprovalRecord]:
        found = {run_id: self._live(run_id) for run_id in run_ids}
        return {run_id: record for run_id, record in found.items() if record is not None}

    async def decide(self, run_id: str, approval_id: str, digest: str, state: str,
                     approver: str, reason: str) -> tuple[str, ApprovalRecord | None]:
        record = self._live(run_id)
        if record is None:
            return MISSING, None
        if not record.pending:
            return NOT_PENDING, record
        if not hmac.compare_digest(id_hash(approval_id), id_hash(record.approval_id)):
            return ID_MISMATCH, record
        if digest and not hmac.compare_digest(digest.encode(), record.digest.encode()):
            return DIGEST_MISMATCH, record
        decided = dataclasses.replace(record, state=state, approver=approver, reason=reason,
                                      decided_ms=now_ms())
        self._replace(decided)
        return DECIDED, decided

    async def settle(self, run_id: str, state: str, reason: str) -> ApprovalRecord | None:
        record = self._live(run_id)
        if record is None or not record.pending:
            return record
        settled = dataclasses.replace(record, state=state, reason=reason, decided_ms=now_ms())
        self._replace(settled)
        return settled

    async def wait(self, run_id: str, within: float) -> ApprovalRecord | None:
        record = self._live(run_id)
        if record is None or not record.pending:
            return record
        event = self._changed.setdefault(run_id, asyncio.Event())
        try:
            await wait_set(event, within)
        finally:
            self._changed.pop(run_id, None)
        return self._live(run_id)

    async def aclose(self) -> None:
        return None


__all__ = [
    "APPROVED",
    "DECIDED",
    "DENIED",
    "DIGEST_MISMATCH",
    "ID_MISMATCH",
    "MISSING",
    "NOT_PENDING",
    "PENDING",
    "STATES",
    "TIMED_OUT",
    "WITHDRAWN",
    "ApprovalRecord",
    "ApprovalStore",
    "MemoryApprovalStore",
    "id_hash",
]
