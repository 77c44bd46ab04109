"""The audit interceptor, outermost in the chain: one audit record for every call attempt.

It opens the call's :class:`~stargrpc.runs.call_record.CallRecord` before anything else runs, so the
record exists even for calls that authentication refuses; the inner parts fill it in
(authentication the principal, ``Runtime.admit`` the tool, run id and arguments). When
the call ends the interceptor names the outcome — from the run's Result for an Execute that
ran, otherwise from the gRPC status the call ended with — and hands the record to the
batched writer.

An Execute's Result is held back until its record is committed, so that every Result a
client has seen has its record in the store even if the process is killed right after
(bounded by ``audit_commit_timeout_seconds``; concurrent calls share one commit): the record's
``before_result``, which Execute awaits with the Result before sending it, commits it.

Notable records (privileged tools, outcomes other than ok) also go to the log as an
``audit`` line; routine ones only with ``audit_log_lines = "all"`` (a structlog line costs
more than the record's commit).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Hashable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog
from google.protobuf import json_format

from stargrpc.audit.key import audit_key_path, load_or_create_key
from stargrpc.audit.record import (
    AuditRecord,
    outcome_for_result,
    outcome_for_status,
    record_of,
    utc_now,
)
from stargrpc.audit.redact import cut
from stargrpc.audit.store import AuditStore, audit_store_url, open_store
from stargrpc.audit.view import AuditLimits
from stargrpc.audit.writer import AuditCommitPending, AuditWriter
from stargrpc.contract import SERVICE_NAME
from stargrpc.forwarded import ForwardedClient
from stargrpc.ids import new_id
from stargrpc.principal import current_principal
from stargrpc.runs.call_record import CallRecord, current_call
from stargrpc.runs.event_sizes import cuts_before_result
from stargrpc.server.interceptors.composed import ComposedInterceptor
from stargrpc.settings import Settings
from stargrpc.v1 import events_pb2, tool_service_pb2

log = structlog.get_logger("stargrpc.audit")

@dataclass
class _AuditedCall:
    """One call being audited: its record, when it began, and whether it is written."""

    record: CallRecord
    time: str = field(default_factory=utc_now)
    written: bool = False
    result: events_pb2.Result | None = None
    #: What the client got less of than the tool gave, as the notices before the Result say.
    cuts: Sequence[str] = ()
    invocation: dict[str, Any] | None = None
    #: The call's task, and what writes the record when it ends if the handler never ran.
    task: asyncio.Task[Any] | None = None
    on_task_done: Callable[[Any], None] | None = None


#: What writing a record gives: the record as stored when it was committed at once, the
#: future of its commit when it was queued, None when it was not written (the writer closed).
_Written = AuditRecord | asyncio.Future[AuditRecord] | None

#: Other Execute calls open from which a record waits (``audit_group_commit_ms``, bounded)
#: for theirs to share its transaction: a server this busy ends calls about a loop turn
#: apart, and a commit each is most of what the audit costs a call there (``bench/README.md``).
#: Below it a record is committed on the next turn, so that a few callers pay no wait.
BUSY_EXECUTES = 8

#: A record waits only while records are arriving: the last Execute's came within this many
#: group waits. Open calls alone do not say that others end soon (long runs, or clients
#: holding streams open, would make every sparse call's record wait for nothing).
ARRIVING_WITHIN_WAITS = 2

_EXECUTE = f"/{SERVICE_NAME}/Execute"

#: The call being audited: set by open_call, read by the wrapped handler, which grpc.aio
#: runs in the same task (so a wrapped handler can be built once per method).
_current = ContextVar[_AuditedCall]("stargrpc_audited_call")


class AuditInterceptor(ComposedInterceptor):
    """Writes one audit record per call attempt (see the module docstring): the composed
    interceptor (:mod:`stargrpc.server.interceptors.composed`) with only its audit stage, which is
    this object.

    Attributes:
        writer: The batched writer records go to.
        view: How much of a call a record keeps, and how a run's arguments, result,
            invocation context and detail become the record's (shared with
            :func:`stargrpc.testing.run_tool`).
        commit_timeout: Longest an Execute's Result waits for its record to be committed.
        log_lines: Which calls get an ``audit`` log line too (``audit_log_lines``).
        forwarded: Checks the HTTP client a call of the server's own HTTP front ends names
            (they vouch with it too): that address is recorded as the call's peer.
    """

    writer: AuditWriter
    view: AuditLimits
    commit_timeout: float
    log_lines: str
    forwarded: ForwardedClient
    _open_calls: int
    _open_executes: int
    _held_results: int
    _executes_settled: asyncio.Event

    def __init__(self, settings: Settings, *, store: AuditStore | None = None) -> None:
        if store is None:
            key = load_or_create_key(audit_key_path(settings))
            store = open_store(audit_store_url(settings), key,
                               sqlite_on_loop=settings.audit_sqlite_append_on_loop)
            # Every worker of the server reads this key: a front end of one vouches for
            # calls that land on another.
            self.forwarded = ForwardedClient.from_secret(key.secret)
        else:
            self.forwarded = ForwardedClient.of_this_process()
        self.writer = AuditWriter(store, max_batch=settings.audit_max_batch,
                                  close_timeout=settings.audit_close_timeout_seconds,
                                  commit_wait=settings.audit_commit_timeout_seconds,
                                  group_wait=settings.audit_group_commit_ms / 1000)
        self.view = AuditLimits.from_settings(settings)
        self.commit_timeout = settings.audit_commit_timeout_seconds
        self.log_lines = settings.audit_log_lines
        self._open_calls = 0
        self._open_executes = 0
        self._held_results = 0
        self._executes_settled = asyncio.Event()
        self._executes_settled.set()
        self._last_record_at = -float("inf")
        self._clock = time.monotonic
        super().__init__(audit=self)

    @property
    def open_calls(self) -> int:
        """Calls whose record is opened but not yet handed to the writer. A client may hold
        its status before the record of its call is handed over (the record is written as
        the handler unwinds): wait for this to reach 0, then flush the writer."""
        return self._open_calls

    async def executes_ended(self) -> None:
        """Waits until no Execute call is open: each has sent its Result, a Result held
        back for its record's commit included (each waits at most
        ``audit_commit_timeout_seconds``). A draining server's runs have ended, but their
        calls may still be on their way to the Result (a slow reader, a held Result): their
        callers are owed it before the transport stops."""
        while self._open_executes or self._held_results:
            # Cleared here too, so that a count raised without clearing it can never make
            # this loop spin (a set event's wait returns without giving the loop a turn).
            self._executes_settled.clear()
            await self._executes_settled.wait()

    def _settle(self) -> None:
        if not self._open_executes and not self._held_results:
            self._executes_settled.set()

    # -- lifecycle (the server calls these) ------------------------------------------------

    async def start(self) -> None:
        """Opens the store and starts the writer."""
        await self.writer.start()

    async def aclose(self) -> None:
        """Writes every queued record, then closes the store."""
        await self.writer.aclose()

    # -- the stage (stargrpc.server.interceptors.composed runs it around each call) ---------------

    def open_call(self, method: str) -> _AuditedCall:
        """Opens the record of a call of ``method`` in this task, before anything else of
        the call runs; it is written when the call ends (:meth:`conclude`), or when the task
        ends if the handler never ran."""
        call = _AuditedCall(CallRecord(method=method))
        call.record.before_result = self._commit
        # grpc.aio serves each call in a task of its own: inner interceptors and the
        # handler see this record, and nothing else does.
        current_call.set(call.record)
        _current.set(call)
        self._open_calls += 1  # until its record is handed to the writer
        if method == _EXECUTE:
            self._open_executes += 1
            self._executes_settled.clear()
        task = asyncio.current_task()
        if task is not None:
            # grpc.aio does not run the handler of a call cancelled before its request
            # arrived: the record is then written when the call's task ends (the handler,
            # once it runs, takes that over: begin).
            call.task = task
            call.on_task_done = lambda _: self._write_unwritten(call)
            task.add_done_callback(call.on_task_done)
        return call

    @staticmethod
    def call_of_task() -> _AuditedCall:
        """The call :meth:`open_call` opened in this task: the wrapped handler, built once
        per method, finds its call here (grpc.aio runs it in the call's task)."""
        return _current.get()

    def unknown_method(self, call: _AuditedCall) -> None:
        """Writes the record of a call of a method that does not exist."""
        call.record.outcome = "invalid"
        call.record.detail = "unknown method"
        self._write(call)

    # -- the record ------------------------------------------------------------------------

    def begin(self, call: _AuditedCall, request: Any, context: grpc.aio.ServicerContext) -> None:
        """Notes what the call's context and request say, as its handler starts (the
        request is None when it is a stream)."""
        if call.task is not None and call.on_task_done is not None:
            # The handler runs: it writes the record however it ends (a callback less to
            # run per call).
            call.task.remove_done_callback(call.on_task_done)
            call.task = call.on_task_done = None
        record = call.record
        # The HTTP client behind a call of the gateway or the MCP endpoint (vouched for, so
        # no gRPC caller can name someone else), else the gRPC peer.
        record.peer = (self.forwarded.client_of(context.invocation_metadata() or ())
                       or context.peer() or "")
        if request is None:
            return
        # What the request names, so that even a call refused before the runtime looked at
        # it is recorded with its tool, run or key (cut: it is unchecked input).
        for name, attribute in _named_by(request.__class__):
            value = getattr(request, attribute, "")
            if value and isinstance(value, str) and not getattr(record, name):
                setattr(record, name, cut(value, 200))
        if isinstance(request, tool_service_pb2.ExecuteRequest) and request.HasField("context"):
            call.invocation = json_format.MessageToDict(request.context,
                                                        preserving_proto_field_name=True)

    async def _commit(self, events: Sequence[events_pb2.RunEvent]) -> None:
        """Writes the record of an Execute whose Result (the last of ``events``) is about to
        be sent, and waits (a bounded time) until it is committed (the call record's
        ``before_result``, awaited in the call's own task)."""
        call = _current.get()
        call.result = events[-1].result
        # Read from what this call streams, so a call that attached to (or replays) the
        # run holding its idempotency key records the cuts too.
        call.cuts = cuts_before_result(events)
        # Held from before its record is written (which closes the Execute) until the
        # Result may go: a draining server waits for it all along (executes_ended).
        self._held_results += 1
        self._executes_settled.clear()
        try:
            future = self.conclude(call, None, None)
            if not isinstance(future, asyncio.Future) or self.commit_timeout <= 0:
                return  # committed already (the stored record), not written, or not waited
            try:
                # The future is this call's alone. The writer bounds the wait itself (one
                # timer per batch that has to wait for the store, none for a commit done at
                # once).
                await future
            except AuditCommitPending:
                log.warning("audit_commit_slow", run_id=call.record.run_id,
                            waited_seconds=self.commit_timeout)
            except RuntimeError:
                pass  # the writer closed; _write logged it
        finally:
            self._held_results -= 1
            self._settle()

    def conclude(self, call: _AuditedCall, context: grpc.aio.ServicerContext | None,
                 exc: BaseException | None) -> _Written:
        """Names the outcome of the call and writes its record (once)."""
        if call.written:
            return None
        record = call.record
        if call.result is not None:
            record.outcome = outcome_for_result(call.result)
            if call.result.HasField("error"):
                record.detail = record.detail or \
                    f"{call.result.error.code}: {call.result.error.message}"
            if call.cuts:  # the client got less than the tool gave: say what
                record.detail = "; ".join(filter(None, (record.detail, *call.cuts)))
        elif not record.outcome:
            record.outcome, detail = _outcome_of_call(context, exc)
            record.detail = record.detail or detail
        if record.extra:  # most calls note nothing more: none of the lookups below
            critic = record.extra.get("critic")
            if critic:  # what the run's critic decided (verdicts, a fallback to the rules)
                record.detail = "; ".join(filter(None, (record.detail, critic)))
            # Where the run waited its turn (a limited lane), and a priority it was refused.
            lane, priority = record.extra.get("lane"), record.extra.get("priority")
            if lane or priority:
                record.detail = "; ".join(filter(None, (
                    record.detail, lane and f"lane {lane}", priority and f"priority {priority}")))
            if record.outcome == "ok" and not record.detail and record.extra.get("idempotent"):
                # The idempotency key was already held: this call attached to (or replayed) the
                # run that holds it instead of running the tool again.
                record.detail = f"{record.extra['idempotent']} the run holding the idempotency key"
            # A call for a session another replica holds: which replica sent it here, or which
            # one this replica forwarded it to.
            forwarded_from, forwarded_to = (record.extra.get("forwarded_from"),
                                            record.extra.get("forwarded_to"))
            if forwarded_from or forwarded_to:
                record.detail = "; ".join(filter(None, (
                    record.detail, forwarded_from and f"forwarded from replica {forwarded_from}",
                    forwarded_to and f"forwarded to replica {forwarded_to}")))
        return self._write(call)

    def _write_unwritten(self, call: _AuditedCall) -> None:
        if call.written:
            return
        record = call.record
        if not record.outcome:
            record.outcome = "cancelled"
            record.detail = record.detail or "the call ended before its handler ran"
        self._write(call)

    def _write(self, call: _AuditedCall) -> _Written:
        call.written = True
        self._open_calls -= 1
        if call.record.method == _EXECUTE:
            self._open_executes -= 1
            self._settle()
        record = self._audit_record(call)
        # The call's record lives on in the context of the run's task, which the run
        # holds: a reference back to the run (or its Result) would keep both alive until
        # the cycle collector's next full collection.
        call.record.run = None
        call.result = None
        notable = record.privileged or record.outcome != "ok"
        if (notable and self.log_lines != "off") or self.log_lines == "all":
            self._log(record, notable)
        now = self._clock()
        arriving = now - self._last_record_at < ARRIVING_WITHIN_WAITS * self.writer.group_wait
        if call.record.method == _EXECUTE:  # other calls' records say nothing of Executes'
            self._last_record_at = now
        try:
            # With no other call open, no record will come to share this one's transaction:
            # commit it at once rather than on the next turn of the loop.
            if self._open_calls == 0:
                return self.writer.submit_alone(record)
            # A busy server, records arriving: the records of the calls ending next may
            # share this one's transaction.
            return self.writer.submit(
                record, more_coming=arriving and self._open_executes >= BUSY_EXECUTES)
        except RuntimeError:
            log.error("audit_record_not_stored", reason="the audit writer is closed",
                      record=record.as_dict())
            return None

    def _audit_record(self, call: _AuditedCall) -> AuditRecord:
        record = call.record
        principal = record.principal
        if principal is None and record.outcome != "unauthenticated":
            principal = current_principal.get()
        run = record.run
        arguments = run.audit_arguments if run is not None else None
        if arguments is None:
            arguments = record.arguments
        # Every field, by name (record_of: no dataclass __init__); the store places it.
        return record_of({
            "id": new_id(),
            "time": call.time,
            "method": record.method,
            "peer": record.peer,
            "principal": principal.id if principal else "",
            "acting_for": principal.acting_for if principal else "",
            "auth_method": principal.method if principal else "",
            "tool": record.tool,
            "run_id": record.run_id,
            "parent_run_id": record.parent_run_id,
            "root_run_id": record.root_run_id,
            "arguments": self.view.arguments_text(arguments),
            "result": self._result_text(call, run.audit_result if run is not None else None),
            "invocation": self.view.invocation_text(call.invocation),
            "outcome": record.outcome,
            "detail": self.view.detail_text(record.detail),
            "duration_ms": round((time.monotonic() - record.started) * 1000, 3),
            "usage": self.view.usage_text(call.result),
            "idempotency_key": record.idempotency_key,
            "privileged": record.privileged,
            "key_id": "", "seq": 0, "prev_hash": "", "hash": "",
        })

    def audit_child(self, record: CallRecord, result: events_pb2.Result | None,
                    time: str) -> None:
        """Writes the record of a child run a tool started (``ctx.call``), which no gRPC
        call carries: when it ends (its ``result``), or when it was refused (None, the
        record's outcome and detail set). The runtime's ``audit_child``."""
        call = _AuditedCall(record, time=time, written=True, result=result,
                            invocation=record.extra.pop("invocation", None) or None)
        if result is not None:
            record.outcome = outcome_for_result(result)
            if result.HasField("error"):
                record.detail = f"{result.error.code}: {result.error.message}"
        audit_record = self._audit_record(call)
        record.run = None  # the run holds this record's closure: no cycle back
        notable = audit_record.privileged or audit_record.outcome != "ok"
        if (notable and self.log_lines != "off") or self.log_lines == "all":
            self._log(audit_record, notable)
        try:
            self.writer.submit(audit_record)
        except RuntimeError:
            log.error("audit_record_not_stored", reason="the audit writer is closed",
                      record=audit_record.as_dict())

    def _result_text(self, call: _AuditedCall, substitute: str | None) -> str:
        if substitute is None:  # the tool chose nothing: what the call chose, if anything
            substitute = call.record.result_view
        return self.view.result_text(call.result, substitute)

    def _log(self, record: AuditRecord, notable: bool) -> None:
        fields: dict[str, Any] = {
            "method": record.method, "tool": record.tool, "principal": record.who,
            "peer": record.peer, "outcome": record.outcome, "detail": record.detail,
            "duration_ms": record.duration_ms, "privileged": record.privileged,
            "idempotency_key": record.idempotency_key, "audit_id": record.id,
        }
        if record.privileged:
            fields["arguments"] = record.arguments
        if record.invocation:
            fields["invocation"] = record.invocation
        # run_id as a field rather than bound to the context: the same line (explicit fields
        # win over bound ones), without binding and resetting a context variable per call.
        fields["run_id"] = record.run_id
        if notable:
            log.warning("audit", **fields)
        else:
            log.info("audit", **fields)


#: What a request may name that its call's record keeps: (record field, request field).
_NAMED = (("tool", "tool_name"), ("run_id", "run_id"), ("idempotency_key", "idempotency_key"))


@functools.cache  # per request type met: the services' message types, a few
def _named_by(kind: Hashable) -> tuple[tuple[str, str], ...]:
    """Which of :data:`_NAMED` a request of class ``kind`` may carry: for a protobuf
    message the fields it defines (the others are never set), worked out once per type
    rather than looked up one by one on every call; for anything else all of them."""
    fields = getattr(getattr(kind, "DESCRIPTOR", None), "fields_by_name", None)
    return _NAMED if fields is None else tuple(pair for pair in _NAMED if pair[1] in fields)


def _outcome_of_call(context: grpc.aio.ServicerContext | None,
                     exc: BaseException | None) -> tuple[str, str]:
    """The outcome and detail of a call that did not end with a Result."""
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        remaining = context.time_remaining() if context is not None else None
        if remaining is not None and remaining <= 0:
            return "timeout", "the caller's deadline expired"
        return "cancelled", "the caller cancelled the call"
    code = context.code() if context is not None else None
    if code is None and exc is not None:
        return "error", f"the handler failed ({type(exc).__name__})"
    details = context.details() if context is not None else ""
    if isinstance(details, bytes):
        details = details.decode("utf-8", errors="replace")
    return outcome_for_status(code), details or ""
