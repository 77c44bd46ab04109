"""The audit record: one row per call attempt, and how a call's outcome is named.

Outcomes are the closed set :data:`OUTCOMES`. A call refused before a run gets its outcome
from the gRPC status (:func:`outcome_for_status`); an Execute that ran gets it from the
run's Result (:func:`outcome_for_result`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import grpc

from stargrpc.ids import new_id
from stargrpc.text import as_text
from stargrpc.v1 import events_pb2

#: Every outcome an audit record can have.
OUTCOMES = ("ok", "denied", "failed", "error", "timeout", "cancelled", "unauthenticated",
            "invalid")

#: The previous hash of the first record of a store.
GENESIS_HASH = "0" * 64

_STATUS_OUTCOMES: dict[grpc.StatusCode, str] = {
    grpc.StatusCode.OK: "ok",
    grpc.StatusCode.UNAUTHENTICATED: "unauthenticated",
    grpc.StatusCode.PERMISSION_DENIED: "denied",
    # The request itself was wrong: a bad field, an unknown tool or run, a stale catalog.
    grpc.StatusCode.INVALID_ARGUMENT: "invalid",
    grpc.StatusCode.NOT_FOUND: "invalid",
    grpc.StatusCode.FAILED_PRECONDITION: "invalid",
    grpc.StatusCode.OUT_OF_RANGE: "invalid",
    grpc.StatusCode.UNIMPLEMENTED: "invalid",
    grpc.StatusCode.ALREADY_EXISTS: "invalid",
    # Well-formed, but it could not be served now (limits, draining, a store down).
    grpc.StatusCode.RESOURCE_EXHAUSTED: "failed",
    grpc.StatusCode.UNAVAILABLE: "failed",
    grpc.StatusCode.ABORTED: "failed",
    grpc.StatusCode.DEADLINE_EXCEEDED: "timeout",
    grpc.StatusCode.CANCELLED: "cancelled",
}


def outcome_for_status(code: grpc.StatusCode | None) -> str:
    """The outcome of a call that ended with gRPC status ``code`` (None counts as OK)."""
    if code is None:
        return "ok"
    return _STATUS_OUTCOMES.get(code, "error")


def outcome_for_result(result: events_pb2.Result) -> str:
    """The outcome of a run, from its Result: "ok", "denied", "failed", … ."""
    # A dict lookup: the enum wrapper's Name() goes through the descriptor on every call.
    # A value this version does not know is an error.
    return _RESULT_OUTCOMES.get(result.outcome, "error")


def _outcome_named(name: str) -> str:
    outcome = name.removeprefix("OUTCOME_").lower()
    return outcome if outcome in OUTCOMES else "error"


#: The outcome of each value the Result's ``outcome`` enum defines.
_RESULT_OUTCOMES = {value: _outcome_named(name)
                    for name, value in events_pb2.Outcome.items()}


def utc_now() -> str:
    """The current time as the store keeps it: fixed-width ISO 8601 in UTC, so that text
    order is time order (:func:`format_time`'s form)."""
    # From one time_ns(), the date and time formatted once per second: a call takes one.
    micros = time.time_ns() // 1000
    seconds, fraction = divmod(micros, 1_000_000)
    cached_seconds, prefix = _second
    if seconds != cached_seconds:
        prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
        _second[:] = (seconds, prefix)
    return f"{prefix}.{fraction:06d}Z"


#: The second :func:`utc_now` last formatted, and its text.
_second: list[Any] = [-1, ""]


def format_time(moment: datetime) -> str:
    """``moment`` as ``2026-01-02T03:04:05.678901Z``."""
    # isoformat writes its one fixed layout directly, where strftime goes through a format
    # string: cheaper, on every call (measured in bench/README.md).
    return moment.astimezone(UTC).replace(tzinfo=None).isoformat(timespec="microseconds") + "Z"


@dataclass(frozen=True)
class AuditRecord:
    """One call attempt, as the audit trail keeps it.

    The store assigns ``seq``, ``prev_hash`` and ``hash`` when it appends the record; every
    other field is final when the record is submitted.

    Attributes:
        id: Unique id of the record.
        time: When the call started (see :func:`utc_now`).
        method: Full gRPC method name.
        peer: The caller's address as gRPC reports it.
        principal: Who called ("" when authentication did not establish anyone).
        acting_for: The end user a delegating caller acted for, when honoured.
        auth_method: How the caller authenticated (api_key, jwt, mtls, none).
        tool: The tool named by an Execute.
        run_id: The run the call started, attached to, watched or cancelled.
        parent_run_id: The run the started run hangs under (a child run, ``ctx.call`` or
            ``parent_run_id``); "" for a top-level run and for calls that start none.
        root_run_id: The root of the started run's call tree (its own id for a top-level
            run); "" for calls that start none (and in records of versions before trees).
        arguments: The arguments as JSON text, secrets redacted and long values truncated
            (or what the tool chose to show instead).
        result: What the run returned, redacted and truncated (or the tool's substitute).
        invocation: The request's invocation context (end user, channel, trace id, session,
            labels) as JSON text, redacted; "" when the request had none.
        outcome: One of :data:`OUTCOMES`.
        detail: A short, user-safe detail (an error code and message).
        duration_ms: How long the call took.
        usage: What the run used (its Result's ``usage``) as compact JSON, only the
            measured figures: ``{"wall_seconds":0.52,"cpu_user_seconds":0.31,…}``; ""
            when the call returned no Result (and in records of versions before it).
        idempotency_key: The request's idempotency key.
        privileged: Whether the tool is privileged.
        key_id: The id of the audit key the record's hash is keyed with ("" for a record
            written without a key, as by versions before keys).
        seq: Position in the store, from 1, gapless.
        prev_hash: The hash of the record before (:data:`GENESIS_HASH` for the first).
        hash: HMAC-SHA-256 with the audit key (SHA-256 for a record without ``key_id``) over
            this record's fields and ``prev_hash``.
    """

    id: str
    time: str
    method: str
    peer: str = ""
    principal: str = ""
    acting_for: str = ""
    auth_method: str = ""
    tool: str = ""
    run_id: str = ""
    parent_run_id: str = ""
    root_run_id: str = ""
    arguments: str = ""
    result: str = ""
    invocation: str = ""
    outcome: str = "ok"
    detail: str = ""
    duration_ms: float = 0.0
    usage: str = ""
    idempotency_key: str = ""
    privileged: bool = False
    key_id: str = ""
    seq: int = 0
    prev_hash: str = ""
    hash: str = ""

    def as_dict(self) -> dict[str, Any]:
        """Every field, JSON-ready."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AuditRecord:
        """A record from a store row (column names are the field names)."""
        values = {name: data[name] for name in FIELDS if name in data}
        values["privileged"] = bool(values.get("privileged", False))
        values["duration_ms"] = float(values.get("duration_ms", 0.0))
        values["seq"] = int(values.get("seq", 0))
        return cls(**values)

    @property
    def who(self) -> str:
        """"alice", or "alice acting for bob"."""
        return f"{self.principal} acting for {self.acting_for}" if self.acting_for \
            else self.principal


#: Field names in storage order.
FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(AuditRecord))


def record_of(values: dict[str, Any]) -> AuditRecord:
    """The record with ``values`` — every field of it, by name, and nothing else — made
    without the frozen dataclass's ``__init__``, which sets each field through a guarded
    ``object.__setattr__`` — dearer than filling the instance's dict at once, and a record
    is made for every call (measured in ``bench/README.md``)."""
    record: AuditRecord = object.__new__(AuditRecord)
    record.__dict__.update(values)
    return record


def storable(record: AuditRecord) -> AuditRecord:
    """``record``, or a copy of it whose texts every store takes (see :func:`_storable`):
    what the audit writer hands the store. A record read back from a store is left as it
    is — its hash was made over its texts as stored."""
    fixed = {name: stored for name, value in record.__dict__.items()
             if type(value) is str and (not value.isascii() or "\x00" in value)
             and (stored := _storable(value)) != value}
    return record_of({**record.__dict__, **fixed}) if fixed else record


def _storable(text: str) -> str:
    """``text``, with any lone surrogate (``"\\ud800"`` in a caller's JSON decodes to one)
    and any NUL written as its escape: the first has no UTF-8 form (no store takes it, nor
    can its hash be made), PostgreSQL's text takes no NUL — and a record a store refuses
    keeps every record queued behind it waiting."""
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    return as_text(text)


#: Longest text a substitute (:func:`refused_substitute`) keeps of a refused record's field.
_SUBSTITUTE_TEXT = 200


def refused_substitute(record: AuditRecord, error: str) -> AuditRecord:
    """What stands in the trail for ``record``, which the store refused for its content
    (the audit writer stores it in its place, and logs ``record`` whole).

    Only what identifies the call is kept, each text cut to 200 characters, since any field
    may be what the store refused: ``id`` (a new one when the record's own is no such
    text), ``time``, ``method``, ``principal``, ``acting_for``, ``auth_method``, ``tool``,
    ``run_id`` and ``outcome``; no arguments, result or invocation. ``detail`` says that the
    record was refused and why (``error``); a duration that is no finite number is 0.
    """
    record_id = _short(record.id)
    duration = record.duration_ms
    finite = type(duration) in (int, float) and math.isfinite(duration)
    return AuditRecord(
        id=record_id if record_id and record_id == record.id else new_id(),
        time=_short(record.time) or utc_now(), method=_short(record.method),
        principal=_short(record.principal), acting_for=_short(record.acting_for),
        auth_method=_short(record.auth_method), tool=_short(record.tool),
        run_id=_short(record.run_id),
        outcome=record.outcome if record.outcome in OUTCOMES else "error",
        detail=_short(f"audit record refused by the store, this substitute stands in for it "
                      f"(the record is in the server log as audit_record_refused): {error}",
                      limit=1000),
        duration_ms=float(duration) if finite and abs(duration) < 1e15 else 0.0,
        privileged=record.privileged is True)


def _short(value: object, limit: int = _SUBSTITUTE_TEXT) -> str:
    """``value`` as a substitute keeps it: text only, storable, at most ``limit`` long."""
    return _storable(value[:limit]) if isinstance(value, str) else ""
