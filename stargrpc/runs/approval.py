"""Human approval, bound to the arguments: runs that wait for a person's yes before they
start.

**Which runs.** A run needs approval when its tool says so (``@tool(approval=True)``) or
the server's ``approval_policy`` does — for the tool by name (``tools``, ``"*"`` for all),
for every run of a caller holding one of ``roles``, or for tools annotated ``destructive``
— unless its caller holds one of ``exempt_roles`` (:class:`ApprovalRules`).

**How it waits.** :meth:`Approvals.request` runs in ``Runtime.admit``, before the call is
answered: it draws a random approval id (never derived from the run id), writes the
pending :class:`~stargrpc.stores.approvals.ApprovalRecord` — with the SHA-256 digest of the
canonical JSON of the arguments (:func:`arguments_digest`, the canonical form the audit
chain hashes: keys sorted, no whitespace, UTF-8) — audits the request and puts the run in
phase ``awaiting_approval``. The run's first gate (:class:`ApprovalGate`, in its own task,
before its START) logs an ``APPROVAL_REQUIRED`` notice with the typed detail, then waits.
The critic's clock does not run meanwhile (supervision times a gated run from its START);
the caller's deadline, CancelRun and a client cancel still end it.

**The decision.** :meth:`Approvals.decide` serves ApproveRun: a holder of
``approver_role`` (held explicitly; ``admin_role`` does not grant it), not on its own run
unless ``approval_allow_self``, with the run's approval id and, when the approver gives it,
the digest it was shown. The store compares and sets in one step, so a decision is taken
once. Approved: an ``APPROVAL_GRANTED`` notice, then the START. Denied: ``Result{DENIED,
APPROVAL_DENIED}`` with the approver and reason. Nobody within ``approval_timeout_seconds``:
``Result{DENIED, APPROVAL_TIMEOUT}``. A run that ends while it waits withdraws its request,
so a late approval is APPROVAL_NOT_PENDING; so does a call ``Runtime.admit`` refuses after
the request was written (:meth:`ApprovalGate.withdraw`). The tool never runs unless approved.

Every request, timeout and withdrawal is an audit record (:attr:`Approvals.on_audit`,
method :data:`APPROVAL_METHOD`); a decision is the audit record of its ApproveRun call.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import hmac
import json
import math
import secrets
import time
import unicodedata
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from stargrpc import metrics
from stargrpc.audit.redact import RedactionLimits, redacted_json
from stargrpc.errors import (
    FailedPrecondition,
    FieldViolation,
    InvalidArgument,
    PermissionDenied,
    RequestError,
    ToolDenied,
    reason_name,
)
from stargrpc.principal import Principal
from stargrpc.registry import ToolSpec
from stargrpc.runs.run import PHASE_AWAITING_APPROVAL, Run
from stargrpc.settings import ApprovalPolicy, Settings
from stargrpc.stores.approvals import (
    APPROVED,
    DECIDED,
    DENIED,
    DIGEST_MISMATCH,
    ID_MISMATCH,
    MISSING,
    TIMED_OUT,
    WITHDRAWN,
    ApprovalRecord,
    ApprovalStore,
    id_hash,
    now_ms,
)
from stargrpc.v1 import errors_pb2, events_pb2

log = structlog.get_logger("stargrpc.approval")

APPROVAL_REQUIRED = reason_name(errors_pb2.APPROVAL_REQUIRED)
APPROVAL_GRANTED = reason_name(errors_pb2.APPROVAL_GRANTED)
APPROVAL_DENIED = reason_name(errors_pb2.APPROVAL_DENIED)
APPROVAL_TIMEOUT = reason_name(errors_pb2.APPROVAL_TIMEOUT)
APPROVAL_NOT_PENDING = reason_name(errors_pb2.APPROVAL_NOT_PENDING)
APPROVAL_ID_MISMATCH = reason_name(errors_pb2.APPROVAL_ID_MISMATCH)
APPROVAL_DIGEST_MISMATCH = reason_name(errors_pb2.APPROVAL_DIGEST_MISMATCH)
APPROVER_ROLE_REQUIRED = reason_name(errors_pb2.APPROVER_ROLE_REQUIRED)
APPROVAL_SELF_NOT_ALLOWED = reason_name(errors_pb2.APPROVAL_SELF_NOT_ALLOWED)

#: The ``method`` of the audit records of approval requests, timeouts and withdrawals
#: (``stargrpc audit query --method``); a decision is recorded as its ApproveRun call.
APPROVAL_METHOD = "/stargrpc.approval/Request"

#: Random bytes of an approval id (its URL-safe text is 32 characters).
APPROVAL_ID_BYTES = 24
#: Every approval id starts so: never with a "-" (base64url has it), which a command line
#: would take for an option (`--approval-id -x…`), and its kind shows, as ``ses_``/``sgk_`` do.
APPROVAL_ID_PREFIX = "apv_"
#: Longest approval id, run id and digest taken by ApproveRun; longer ones are refused.
MAX_APPROVAL_ID_CHARS = 128
MAX_RUN_ID_CHARS = 128
#: Longest reason an approver may give (characters).
MAX_REASON_CHARS = 1000
#: How long the record of a decided request outlives its deadline (a late ApproveRun is
#: then told APPROVAL_NOT_PENDING, not NOT_FOUND; ListRuns shows the decision).
RECORD_RETENTION_SECONDS = 3600.0
#: How long a waiting run pauses before it asks a store that failed again.
STORE_RETRY_SECONDS = 1.0

#: What an approver decides, by the contract's ApprovalVerdict value.
VERDICT_STATES = {1: APPROVED, 2: DENIED}

#: The ``decision`` label of the approval metrics, by the state a request ended in.
DECISION_LABELS = {APPROVED: "approved", DENIED: "denied", TIMED_OUT: "timeout",
                   WITHDRAWN: "withdrawn"}


def canonical_arguments(arguments: Mapping[str, Any]) -> bytes:
    """The canonical JSON of ``arguments``: keys sorted, no whitespace, UTF-8 (the form the
    audit chain hashes its records in)."""
    return json.dumps(arguments, sort_keys=True, ensure_ascii=False, separators=(",", ":"),
                      default=str).encode("utf-8", "surrogatepass")


def arguments_digest(arguments: Mapping[str, Any]) -> str:
    """The hex SHA-256 of :func:`canonical_arguments`: what a decision binds to."""
    return hashlib.sha256(canonical_arguments(arguments)).hexdigest()


@dataclass(frozen=True)
class ApprovalRules:
    """Which runs need approval, and who decides (from the settings).

    Attributes:
        policy: ``approval_policy``.
        approver_role: The role that decides.
        allow_self: Whether an approver may decide on its own run.
        timeout: Seconds a run waits for a decision.
    """

    policy: ApprovalPolicy
    approver_role: str
    allow_self: bool
    timeout: float

    @classmethod
    def from_settings(cls, settings: Settings) -> ApprovalRules:
        """The rules ``settings`` configure."""
        return cls(settings.approval_policy, settings.approver_role,
                   settings.approval_allow_self, settings.approval_timeout_seconds)

    def required(self, spec: ToolSpec, principal: Principal) -> bool:
        """Whether a run of ``spec`` by ``principal`` waits for approval."""
        policy = self.policy
        if any(principal.has_role(role) for role in policy.exempt_roles):
            return False
        return (spec.approval or spec.name in policy.tools or "*" in policy.tools
                or (policy.destructive and spec.annotations.destructive)
                or any(principal.has_role(role) for role in policy.roles))


@dataclass(frozen=True)
class ApprovalFact:
    """A step of an approval request for the audit trail.

    Attributes:
        event: "requested", "timed_out" or "withdrawn".
        record: The request as it stands after the step.
    """

    event: str
    record: ApprovalRecord


def fill_request(message: events_pb2.ApprovalRequest, record: ApprovalRecord) -> None:
    """Sets the contract's ApprovalRequest from ``record``."""
    message.approval_id = record.approval_id
    message.tool_name = record.tool
    message.principal = record.principal
    message.arguments_digest = record.digest
    message.arguments = record.arguments
    message.requested_at.FromMilliseconds(record.requested_ms)
    message.deadline.FromMilliseconds(record.deadline_ms)


class Approvals:
    """The approval room of a runtime: its rules, where requests live, and the audit.

    Attributes:
        rules: Which runs need approval, and who decides.
        store: Where requests and decisions live (the run store's ``approvals`` in a fleet).
        on_audit: Called with each request, timeout and withdrawal (the server sets it to
            write an audit record).
    """

    rules: ApprovalRules
    store: ApprovalStore
    on_audit: Callable[[ApprovalFact], None] | None

    def __init__(self, settings: Settings, store: ApprovalStore) -> None:
        self.rules = ApprovalRules.from_settings(settings)
        self.store = store
        self.on_audit = None
        # What the request shows of the arguments: the audit's redacted view.
        self._shown = RedactionLimits(max_value_chars=settings.audit_max_value_chars,
                                      max_total_chars=settings.audit_max_arguments_chars)

    def required(self, spec: ToolSpec, principal: Principal) -> bool:
        """Whether a run of ``spec`` by ``principal`` waits for approval."""
        return self.rules.required(spec, principal)

    def count_end(self, record: ApprovalRecord, state: str) -> None:
        """Counts the end of ``record``'s request in ``state`` and how long it waited
        (from its request, by this process's clock: the one that wrote ``requested_ms``)."""
        decision = DECISION_LABELS.get(state, "timeout")
        metrics.APPROVAL_DECISIONS.labels(decision).inc()
        metrics.APPROVAL_WAIT_SECONDS.labels(decision).observe(
            max(0, now_ms() - record.requested_ms) / 1000)

    def audit(self, event: str, record: ApprovalRecord) -> None:
        """Hands a step of ``record`` to the audit (never fails the run)."""
        if self.on_audit is None:
            return
        try:
            self.on_audit(ApprovalFact(event, record))
        except Exception:
            log.exception("approval_audit_failed", run_id=record.run_id, approval=event)

    async def request(self, run: Run, arguments: Mapping[str, Any]) -> ApprovalGate:
        """Writes the pending request of ``run`` (before its call is answered), audits it
        and puts the run in phase ``awaiting_approval``.

        Returns:
            The gate the run waits in (its first).

        Raises:
            Unavailable: The store cannot be reached (the run must not start).
        """
        requested = now_ms()
        record = ApprovalRecord(
            run_id=run.run_id,
            approval_id=APPROVAL_ID_PREFIX + secrets.token_urlsafe(APPROVAL_ID_BYTES),
            tool=run.spec.name, owner=run.principal.id, principal=run.principal.describe(),
            digest=arguments_digest(arguments),
            arguments=redacted_json(dict(arguments), self._shown),
            requested_ms=requested,
            deadline_ms=requested + math.ceil(self.rules.timeout * 1000))
        ttl_ms = math.ceil((self.rules.timeout + RECORD_RETENTION_SECONDS) * 1000)
        await self.store.put(record, ttl_ms)
        metrics.APPROVAL_REQUESTS.labels(record.tool).inc()
        self.audit("requested", record)
        run.phase = PHASE_AWAITING_APPROVAL
        return ApprovalGate(self, record)

    async def decide(self, principal: Principal, owner: str, run_id: str, approval_id: str,
                     verdict: int, reason: str, digest: str, *, run_ended: bool = False
                     ) -> ApprovalRecord:
        """Takes an approver's decision on the request of run ``run_id`` (owned by
        ``owner``), after :func:`check_decision` took the request apart.

        Args:
            run_ended: The run has its Result already. Its request, if still pending (its
                replica died while it waited), is withdrawn instead: a decision on it could
                start nothing.

        Returns:
            The decided record.

        Raises:
            PermissionDenied: APPROVER_ROLE_REQUIRED, APPROVAL_SELF_NOT_ALLOWED,
                APPROVAL_ID_MISMATCH.
            FailedPrecondition: APPROVAL_NOT_PENDING, APPROVAL_DIGEST_MISMATCH.
            Unavailable: The store cannot be reached.
        """
        rules = self.rules
        if not principal.has_role(rules.approver_role):
            raise PermissionDenied(
                f"deciding on a run needs the role {rules.approver_role!r}",
                reason=APPROVER_ROLE_REQUIRED,
                metadata={"run_id": run_id, "required_role": rules.approver_role})
        record = await self.store.get(run_id)
        if record is not None and record.pending and run_ended:
            record = await self.store.settle(run_id, WITHDRAWN, "the run ended while it waited")
            if record is not None and record.state == WITHDRAWN:
                self.audit("withdrawn", record)
        if record is not None and _same_decision_again(record, principal, approval_id,
                                                       VERDICT_STATES[verdict]):
            # A retry of a decision that was taken (its answer lost: a stalled store, a
            # dropped connection) gets the same answer, not "not pending".
            return record
        if record is None or not record.pending:
            raise not_pending(run_id, record)
        if owner == principal.id and not rules.allow_self:
            raise PermissionDenied("the caller started this run and may not decide on it "
                                   "(approval_allow_self is off)",
                                   reason=APPROVAL_SELF_NOT_ALLOWED, metadata={"run_id": run_id})
        answer, found = await self.store.decide(run_id, approval_id, digest,
                                                VERDICT_STATES[verdict], principal.id, reason)
        if answer == DECIDED and found is not None:
            return found
        if answer == ID_MISMATCH:
            raise PermissionDenied("the approval id is not this run's",
                                   reason=APPROVAL_ID_MISMATCH, metadata={"run_id": run_id})
        if answer == DIGEST_MISMATCH and found is not None:
            raise FailedPrecondition(
                "the run's arguments are not the ones whose digest was given",
                reason=APPROVAL_DIGEST_MISMATCH,
                metadata={"run_id": run_id, "arguments_digest": found.digest})
        raise not_pending(run_id, None if answer == MISSING else found)


def _same_decision_again(record: ApprovalRecord, principal: Principal, approval_id: str,
                         state: str) -> bool:
    """Whether ``record`` holds the decision ``principal`` now asks for, taken by it with
    this approval id (compared by hash, in constant time)."""
    return (not record.pending and record.state == state and record.approver == principal.id
            and hmac.compare_digest(id_hash(approval_id), id_hash(record.approval_id)))


def not_pending(run_id: str, record: ApprovalRecord | None) -> FailedPrecondition:
    """The refusal of a decision on a run that does not wait for one."""
    state = record.state if record is not None else "none"
    return FailedPrecondition("the run does not wait for approval" + (
        f" (its request is {state.replace('_', ' ')})" if record is not None else ""),
        reason=APPROVAL_NOT_PENDING, metadata={"run_id": run_id, "state": state})


def check_decision(run_id: str, approval_id: str, verdict: int, reason: str,
                   digest: str) -> None:
    """Refuses a malformed ApproveRun request before anything is looked up.

    Raises:
        InvalidArgument: With a BadRequest violation per bad field.
    """
    violations = []
    if not run_id:
        violations.append(FieldViolation("run_id", "must not be empty"))
    elif len(run_id) > MAX_RUN_ID_CHARS:
        violations.append(FieldViolation("run_id", f"at most {MAX_RUN_ID_CHARS} characters"))
    if not approval_id:
        violations.append(FieldViolation("approval_id", "must not be empty"))
    elif len(approval_id) > MAX_APPROVAL_ID_CHARS or not approval_id.isascii() \
            or not approval_id.isprintable():
        violations.append(FieldViolation(
            "approval_id", f"at most {MAX_APPROVAL_ID_CHARS} printable ASCII characters"))
    if verdict not in VERDICT_STATES:
        violations.append(FieldViolation("decision", "APPROVAL_VERDICT_APPROVE or "
                                                     "APPROVAL_VERDICT_DENY"))
    if len(reason) > MAX_REASON_CHARS:
        violations.append(FieldViolation("reason", f"at most {MAX_REASON_CHARS} characters"))
    elif any(unicodedata.category(c) in ("Cc", "Cs") and c not in "\n\t" for c in reason):
        violations.append(FieldViolation("reason", "no control characters but line breaks "
                                                   "and tabs"))
    if digest and (len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest)):
        violations.append(FieldViolation("arguments_digest", "64 lowercase hex digits "
                                                             "(ApprovalRequest.arguments_digest)"))
    if violations:
        raise InvalidArgument("the approval request is malformed", violations)


class ApprovalGate:
    """The run's first gate when it needs approval: the APPROVAL_REQUIRED notice, then the
    wait for a decision (see the module docstring)."""

    def __init__(self, approvals: Approvals, record: ApprovalRecord) -> None:
        self._approvals = approvals
        self._record = record

    @property
    def record(self) -> ApprovalRecord:
        """The request as written."""
        return self._record

    async def __call__(self, run: Run) -> None:
        record = self._record
        run.phase = PHASE_AWAITING_APPROVAL
        # Counted before the notice goes out: whoever sees the notice sees the gauge count it.
        metrics.APPROVALS_PENDING.inc()
        try:
            await run.emit_notice(
                APPROVAL_REQUIRED, f"waiting for approval of {record.tool} (approval id "
                f"{record.approval_id}, arguments sha256 {record.digest})", warning=False,
                detail=lambda notice: fill_request(notice.approval, record))
            decided = await self._wait(run)
        except asyncio.CancelledError:
            # The run ends while it waits (cancelled, its caller's deadline, shutdown): the
            # request is withdrawn, in the background (this task is being cancelled).
            self._withdraw_later("the run ended while it waited")
            raise
        finally:
            metrics.APPROVALS_PENDING.dec()
        self._approvals.count_end(record, decided.state)
        if decided.state == APPROVED:
            def fill(notice: events_pb2.Notice) -> None:
                decision = notice.approval_decision
                decision.approver = decided.approver
                decision.reason = decided.reason
                decision.decided_at.FromMilliseconds(decided.decided_ms)
            await run.emit_notice(APPROVAL_GRANTED, f"approved by {decided.approver}"
                                  + (f": {decided.reason}" if decided.reason else ""),
                                  warning=False, detail=fill)
            return
        if decided.state == DENIED:
            raise ToolDenied(f"denied by {decided.approver}"
                             + (f": {decided.reason}" if decided.reason else ""),
                             code=APPROVAL_DENIED)
        raise ToolDenied(f"nobody approved the run within "
                         f"{self._approvals.rules.timeout:g} s", code=APPROVAL_TIMEOUT)

    async def _wait(self, run: Run) -> ApprovalRecord:
        """The record once it left ``pending``: decided, or timed out here at its deadline.
        A store that fails is asked again; at the deadline the run is denied all the same
        (fail closed)."""
        store, record = self._approvals.store, self._record
        while True:
            left = record.deadline_ms / 1000 - time.time()
            if left <= 0:
                return await self._time_out()
            try:
                found = await store.wait(run.run_id, left)
            except RequestError as exc:
                log.warning("approval_wait_failed", run_id=run.run_id, error=str(exc))
                await asyncio.sleep(min(STORE_RETRY_SECONDS, max(0.0, left)))
                continue
            if found is None:  # expired or deleted under the run: nobody can approve it
                return dataclasses.replace(record, state=TIMED_OUT)
            if not found.pending:
                return found

    async def _time_out(self) -> ApprovalRecord:
        record = self._record
        try:
            settled = await self._approvals.store.settle(
                record.run_id, TIMED_OUT, "no decision within approval_timeout_seconds")
        except RequestError as exc:
            log.warning("approval_timeout_not_stored", run_id=record.run_id, error=str(exc))
            settled = None
        if settled is None:
            settled = dataclasses.replace(record, state=TIMED_OUT, decided_ms=now_ms())
        if settled.state == TIMED_OUT:
            self._approvals.audit("timed_out", settled)
        return settled  # a decision that came first stands

    def _withdraw_later(self, reason: str) -> None:
        task = asyncio.get_running_loop().create_task(self.withdraw(reason))
        _WITHDRAWALS.add(task)
        task.add_done_callback(_WITHDRAWALS.discard)

    async def withdraw(self, reason: str) -> None:
        """Withdraws the request while it is pending (its run will not start): audited and
        counted; a store that fails is left to the request's own deadline (never raises)."""
        record = self._record
        with contextlib.suppress(Exception):
            settled = await self._approvals.store.settle(record.run_id, WITHDRAWN, reason)
            if settled is not None and settled.state == WITHDRAWN:
                self._approvals.count_end(record, WITHDRAWN)
                self._approvals.audit("withdrawn", settled)


#: Withdrawals under way (held until done, or the loop may drop them).
_WITHDRAWALS: set[asyncio.Task[None]] = set()
