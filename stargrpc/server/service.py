"""ToolService: maps the protobuf contract onto the runtime, and nothing else.

Failures before a run starts end the call with a gRPC status carrying rich details
(:mod:`stargrpc.errors`); once a run has started every failure is its Result.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
import structlog
from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message

from stargrpc import metrics
from stargrpc.contract import SERVICE_NAME
from stargrpc.critic.supervision import SupervisedRequest, SupervisionPolicy
from stargrpc.delivery import Deliveries, DeliveryTarget
from stargrpc.delivery.target import checked_target
from stargrpc.errors import (
    FieldViolation,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    RequestError,
    RunFinished,
    Unavailable,
    reason_name,
)
from stargrpc.principal import MAX_PRINCIPAL_CHARS, Principal, current_principal
from stargrpc.registry import Registry, ToolSpec
from stargrpc.runs.approval import check_decision, fill_request
from stargrpc.runs.arguments import decode_json, decode_struct
from stargrpc.runs.call_record import current_call
from stargrpc.runs.event_sizes import trailing_notices
from stargrpc.runs.outcome import Outcome
from stargrpc.runs.run import PHASE_QUEUED, Run, check_steer_message
from stargrpc.runs.runtime import Admission, RunRequest, Runtime
from stargrpc.runs.trees import MAX_RUN_ID_CHARS, cancel_subtree
from stargrpc.server.streaming import (
    EventFrame,
    StreamedResponse,
    batch_responses,
    event_responses,
    serialize_response,
)
from stargrpc.sessions.forwarding import SessionForwarder, is_forwarded
from stargrpc.sessions.listing import fleet_sessions
from stargrpc.sessions.registry import Sessions
from stargrpc.sessions.session import Session
from stargrpc.settings import Settings
from stargrpc.stores.approvals import ApprovalRecord
from stargrpc.stores.base import (
    RunLog,
    RunQuery,
    RunSummary,
    decode_page_token,
    encode_page_token,
    run_finished_error,
)
from stargrpc.v1 import catalog_pb2, errors_pb2, events_pb2, tool_service_pb2

_EXECUTE_EVENTS = metrics.EVENTS_STREAMED.labels("Execute")
_WATCH_EVENTS = metrics.EVENTS_STREAMED.labels("WatchRun")

_RUN_NOT_FOUND = reason_name(errors_pb2.RUN_NOT_FOUND)
_STEER_NOT_ALLOWED = reason_name(errors_pb2.STEER_NOT_ALLOWED)


class MalformedRequest:
    """Stands in for a request whose bytes could not be decoded, so the handler can answer
    INVALID_ARGUMENT with details instead of the transport's bare INTERNAL."""

    def __init__(self, message_type: str, error: Exception) -> None:
        self.message_type = message_type
        self.error = error

    def to_error(self) -> InvalidArgument:
        """The status to answer with."""
        return InvalidArgument(
            f"the {self.message_type} could not be decoded",
            [FieldViolation("request", "malformed protobuf, or nested more deeply than the "
                            "decoder allows (100 levels)")])


def _tolerant(message_class: type[Message]) -> Callable[[bytes], Any]:
    name = message_class.DESCRIPTOR.name

    def deserialize(data: bytes) -> Any:
        try:
            return message_class.FromString(data)
        except (DecodeError, RecursionError, ValueError) as exc:
            return MalformedRequest(name, exc)

    return deserialize


def _well_formed(request: Any) -> None:
    """Raises the INVALID_ARGUMENT of a request whose bytes could not be decoded."""
    if isinstance(request, MalformedRequest):
        raise request.to_error()


#: The longest text of an invocation context's ``end_user``, ``channel``, ``trace_id`` and
#: ``session_id``: each goes into the run's audit record (``end_user`` as the principal the
#: call acts for, so as long as a principal id may be), so a caller must not make it as
#: large as the request may be.
MAX_CONTEXT_TEXT = MAX_PRINCIPAL_CHARS
#: The most labels an invocation context may carry, and the longest key and value of one.
MAX_LABELS, MAX_LABEL_KEY, MAX_LABEL_VALUE = 64, 128, 1024


def _check_context(context: tool_service_pb2.InvocationContext) -> None:
    """Raises the INVALID_ARGUMENT of an invocation context over its limits (each field
    that is, named)."""
    violations = [FieldViolation(f"context.{name}", f"at most {MAX_CONTEXT_TEXT} characters")
                  for name in ("end_user", "channel", "trace_id", "session_id")
                  if len(getattr(context, name)) > MAX_CONTEXT_TEXT]
    labels = context.labels
    if len(labels) > MAX_LABELS:
        violations.append(FieldViolation("context.labels", f"at most {MAX_LABELS} labels"))
    elif any(len(key) > MAX_LABEL_KEY or len(value) > MAX_LABEL_VALUE
             for key, value in labels.items()):
        violations.append(FieldViolation(
            "context.labels", f"keys of at most {MAX_LABEL_KEY} characters and values of "
            f"at most {MAX_LABEL_VALUE}"))
    if violations:
        raise InvalidArgument("the invocation context is over its limits", violations)


#: (Not ``log``: the handlers name a run's log so.)
server_log = structlog.get_logger("stargrpc.server")


async def _internal_failure(context: grpc.aio.ServicerContext, method: str) -> None:
    """Ends the call with INTERNAL for an unexpected exception being handled: grpc.aio
    would answer UNKNOWN with the exception's text (a server path, say); the traceback goes
    to the log, the caller learns only that the fault was the server's. Never returns."""
    server_log.exception("rpc_failed", method=method)
    await Internal("the server failed to serve this request (an internal error; its log "
                   "has the details)").abort(context)

_Handler = TypeVar("_Handler", bound=Callable[..., Awaitable[Any]])


def _statuses(handler: _Handler) -> _Handler:
    """A unary handler whose refusals (a :class:`RequestError` it raises) end the call with
    their gRPC status: the one place such a handler maps them."""

    @functools.wraps(handler)
    async def mapped(self: ToolService, request: Any, context: grpc.aio.ServicerContext
                     ) -> Any:
        try:
            _well_formed(request)
            return await handler(self, request, context)
        except RequestError as error:
            await error.abort(context)
            raise  # abort never returns
        except grpc.aio.AbortError:
            raise  # the handler ended the call itself
        except Exception:
            await _internal_failure(context, handler.__name__)
            raise  # abort never returns

    return mapped  # type: ignore[return-value]


class ToolService:
    """The stargrpc.v1.ToolService implementation."""

    runtime: Runtime
    deliveries: Deliveries
    sessions: Sessions
    #: Sends calls for a session another replica holds there (None: no fleet forwarding).
    forwarder: SessionForwarder | None
    _tool_messages: tuple[str, dict[str, catalog_pb2.Tool]]

    def __init__(self, runtime: Runtime, deliveries: Deliveries | None = None) -> None:
        self.runtime = runtime
        self.deliveries = (deliveries if deliveries is not None
                           else Deliveries(runtime.settings, runtime.store))
        self.sessions = Sessions(runtime.settings)
        self.forwarder = None
        self._tool_messages = ("", {})

    # -- catalog ---------------------------------------------------------------------------

    @_statuses
    async def ListTools(self, request: Any, context: grpc.aio.ServicerContext
                        ) -> tool_service_pb2.ListToolsResponse:
        registry = self.runtime.registry
        if request.known_catalog_hash and request.known_catalog_hash == registry.catalog_hash:
            return tool_service_pb2.ListToolsResponse(catalog_hash=registry.catalog_hash,
                                                      not_modified=True)
        return tool_service_pb2.ListToolsResponse(tools=self._tools_for_caller(registry),
                                                  catalog_hash=registry.catalog_hash)

    async def WatchCatalog(self, request: Any, context: grpc.aio.ServicerContext
                           ) -> AsyncIterator[tool_service_pb2.WatchCatalogResponse]:
        try:
            _well_formed(request)
        except RequestError as error:
            await error.abort(context)
        try:
            async for registry in self.runtime.catalog_updates(request.known_catalog_hash):
                yield tool_service_pb2.WatchCatalogResponse(
                    tools=self._tools_for_caller(registry),
                    catalog_hash=registry.catalog_hash)
        except grpc.aio.AbortError:
            raise
        except Exception:
            await _internal_failure(context, "WatchCatalog")

    def _tools_for_caller(self, registry: Registry) -> list[catalog_pb2.Tool]:
        cached_hash, messages = self._tool_messages
        if cached_hash != registry.catalog_hash:
            messages = {name: tool_message(spec) for name, spec in registry.items()}
            self._tool_messages = (registry.catalog_hash, messages)
        principal = current_principal.get()
        tools = []
        show_all = self.runtime.settings.list_tools_show_uncallable
        for name, spec in registry.items():
            may_run = self.runtime.policy.can_run(principal, spec)
            if not may_run and not show_all:
                continue  # by default a caller sees only the tools it may run
            message = catalog_pb2.Tool()
            message.CopyFrom(messages[name])
            # Who may run it as configured, which may differ from what the tool declares.
            access = self.runtime.policy.access(spec)
            permissions = message.permissions
            del permissions.allowed_roles[:]
            permissions.allowed_roles.extend(access.roles)
            permissions.allowed_principals.extend(access.principals)
            permissions.privileged = access.privileged
            permissions.callable = may_run
            message.requires_approval = self.runtime.approvals.required(spec, principal)
            tools.append(message)
        return tools

    # -- runs ------------------------------------------------------------------------------

    async def Execute(self, request: Any, context: grpc.aio.ServicerContext
                      ) -> AsyncIterator[StreamedResponse]:
        # The critic interceptor hands the request over with its call's supervision policy;
        # without it in the chain the policy is built here, the same way.
        if isinstance(request, SupervisedRequest):
            request, policy = request.request, request.policy
        else:
            policy = SupervisionPolicy.for_call(self.settings, context.time_remaining())
        admitted: Admission | None = None
        streamed_to_end = False
        record = current_call.get()
        before_result = record.before_result if record is not None else None
        sent = 0  # events sent and not counted yet: counted once per batch
        # The notices that ended the batches streamed so far: a run announces what it cut
        # in notices right before its Result, and a batch may end between the two (the run
        # gave the loop a turn, a shared log's read split them).
        notices: list[events_pb2.RunEvent] = []
        try:
            _well_formed(request)
            replica = await self._session_replica(request, context)
            if replica is not None:
                assert self.forwarder is not None
                try:
                    async for forwarded in self.forwarder.execute(
                            replica, request, current_principal.get(), context):
                        yield forwarded
                except grpc.aio.AioRpcError as error:  # the owner refused: its status
                    await context.abort(error.code(), error.details() or "",
                                        error.trailing_metadata())
                streamed_to_end = True
                return
            admitted = await self._admit(request, policy)
            log, coalesce = admitted.log, request.coalesce_deltas
            if admitted.run is not None:
                # The run's task was scheduled when the run started: one turn of the loop
                # lets it go first, so that a run that ends without waiting (most do) is
                # read in one batch, with no wake-up of this stream (an event and a loop
                # turn less per call). Inside the try: a call cancelled here stops its run.
                await asyncio.sleep(0)
            # Pre-serialised responses (and the Result as a message), as
            # stargrpc.server.streaming.event_responses makes them, written out here: one async
            # generator less for every message of every Execute. (aclose in a finally rather
            # than contextlib.aclosing: two coroutines less per call.)
            batches = log.follow_batches(0)
            try:
                async for batch in batches:
                    for response in batch_responses(log, batch, coalesce):
                        if response is None:  # the Result, the run's last event
                            if before_result is not None:
                                await before_result([*notices, *batch])
                            yield tool_service_pb2.ExecuteResponse(event=batch[-1])
                            sent += 1
                            streamed_to_end = True
                            return
                        yield response
                        sent += response.events
                    notices = trailing_notices(notices, batch)
                    if sent:
                        _EXECUTE_EVENTS.inc(sent)
                        sent = 0
            finally:
                await batches.aclose()
            streamed_to_end = True
        except RequestError as error:  # refused, or an attached run's shared store went away
            await error.abort(context)
        except grpc.aio.AbortError:
            raise
        except Exception:
            await _internal_failure(context, "Execute")
        finally:
            if sent:
                _EXECUTE_EVENTS.inc(sent)
            # The stream went away early (cancelled, or closed at a yield). A run with an
            # idempotency key outlives it (resume with WatchRun or retry with the key); one
            # without a key has no way back, so it is cancelled.
            if (not streamed_to_end and admitted is not None and admitted.run is not None
                    and not request.idempotency_key):
                admitted.run.stop(Outcome.CANCELLED, "CLIENT_CANCELLED",
                                   "the client cancelled the call")

    @_statuses
    async def StartRun(self, request: Any, context: grpc.aio.ServicerContext
                       ) -> tool_service_pb2.StartRunResponse:
        # A detached run is supervised by the server's own timeouts: the deadline of this
        # unary call is not the run's.
        policy = SupervisionPolicy.for_call(self.settings)
        replica = await self._session_replica(request, context)
        if replica is not None:
            return await self._forward_unary(replica, "StartRun", request,
                                             tool_service_pb2.StartRunResponse, context)
        admitted = await self._admit(request, policy)
        return tool_service_pb2.StartRunResponse(run_id=admitted.log.run_id,
                                                 attached=admitted.run is None)

    async def _session_replica(self, request: Any, context: grpc.aio.ServicerContext
                               ) -> str | None:
        """The replica a request for a session held elsewhere goes to (None: here).

        Raises:
            NotFound: Another principal's session (SESSION_NOT_FOUND).
            FailedPrecondition: Its replica is gone (SESSION_LOST).
            Unavailable: The fleet's store cannot be reached.
        """
        session_id = request.session_id
        if (not session_id or self.forwarder is None or self.sessions.holds(session_id)
                or len(session_id) > 64):
            return None
        try:
            replica = await self.forwarder.route(session_id, current_principal.get().id,
                                                 context.invocation_metadata() or ())
        except RequestError:
            raise
        except Exception as exc:  # the fleet's Redis
            raise Unavailable("the fleet's store cannot be reached to find the session",
                              retry_after=1.0) from exc
        record = current_call.get()
        if replica is not None and record is not None:
            record.extra["forwarded_to"] = replica  # the audit says where the call went
        return replica

    async def _forward_unary(self, replica: str, method: str, request: Any,
                             reply_type: Any, context: grpc.aio.ServicerContext) -> Any:
        """A unary call answered by the replica that holds its session."""
        assert self.forwarder is not None
        try:
            return await self.forwarder.unary(replica, method, request, reply_type,
                                              current_principal.get(), context)
        except grpc.aio.AioRpcError as error:  # the owner refused: its status, as it gave it
            await context.abort(error.code(), error.details() or "",
                                error.trailing_metadata())

    async def _admit(self, request: tool_service_pb2.ExecuteRequest
                     | tool_service_pb2.StartRunRequest, policy: SupervisionPolicy
                     ) -> Admission:
        """What Execute and StartRun share: the request decoded, its delivery target
        checked, the run admitted, and its Result's delivery arranged.

        Raises:
            RequestError: Any reason to refuse the call before its run starts.
        """
        call = self._decode_execute(request, policy)
        target = (await self._delivery_target(request) if request.HasField("delivery")
                  else None)
        before_start = None
        if target is not None:
            async def before_start(run: Run) -> None:
                # Durable before the call is answered: a call answered is a delivery made.
                await self.deliveries.register(run.log, run.spec.name, target)
        admitted = await self.runtime.admit(call, current_principal.get(),
                                            before_start=before_start)
        self._deliver(admitted, target)
        return admitted

    async def _delivery_target(self, request: tool_service_pb2.ExecuteRequest
                               | tool_service_pb2.StartRunRequest) -> DeliveryTarget | None:
        """The request's delivery target, checked (None when it names none)."""
        if not request.HasField("delivery"):
            return None
        return await checked_target(request.delivery, self.settings,
                                    fleet=self.deliveries.fleet)

    def _deliver(self, admitted: Admission, target: DeliveryTarget | None) -> None:
        """Has the Result of a run this call started delivered to ``target``. A call that
        attached to the run holding its idempotency key adds no delivery: the first call's
        target is the run's."""
        if target is not None and admitted.run is not None:
            self.deliveries.track(admitted.run.run_id, admitted.run.spec.name, target)

    def _decode_execute(self, request: tool_service_pb2.ExecuteRequest
                        | tool_service_pb2.StartRunRequest,
                        policy: SupervisionPolicy) -> RunRequest:
        limits = self.runtime.limits
        which = request.WhichOneof("args")
        if which == "arguments_json":
            arguments = decode_json(request.arguments_json, limits)
        elif which == "arguments":
            arguments = decode_struct(request.arguments, limits)
        else:
            arguments = {}
        # Most calls carry no invocation context: skip the (slow) generic conversion for them.
        invocation: dict[str, Any] = {}
        if request.HasField("context"):
            _check_context(request.context)
            invocation = json_format.MessageToDict(request.context,
                                                   preserving_proto_field_name=True)
        session_id = request.session_id
        return RunRequest(tool_name=request.tool_name, arguments=arguments,
                           catalog_hash=request.catalog_hash,
                           idempotency_key=request.idempotency_key, invocation=invocation,
                           policy=policy, parent_run_id=request.parent_run_id,
                           # Most calls name no session: no lookup for them.
                           session=self.sessions.for_call(
                               current_principal.get().id, session_id,
                               request.tool_name, no_wait=request.session_no_wait)
                           if session_id else None,
                           lane=request.lane,
                           priority=request.priority,
                           max_wait_seconds=request.max_wait_seconds)

    async def WatchRun(self, request: Any, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[StreamedResponse]:
        try:
            _well_formed(request)
            run_id, after_seq = request.run_id, request.after_seq
            log = await self._visible_run(run_id, self.runtime.run_access.may_watch)
            if log.finished and after_seq >= log.last_seq:
                raise await self._run_finished(log, after_seq)
            result_sent = False
            async for response in event_responses(
                    log, after_seq, tool_service_pb2.WatchRunResponse,
                    coalesce=request.coalesce_deltas,
                    max_lag=self.settings.max_watch_lag_events, count=_WATCH_EVENTS.inc):
                result_sent = not isinstance(response, EventFrame)
                yield response
            if not result_sent:
                # The run ended at or before after_seq while this call waited: say so,
                # rather than end with OK as a cut stream would.
                finished = await self.runtime.store.open(run_id)
                if finished is None:
                    raise NotFound("the run has expired", reason=_RUN_NOT_FOUND)
                raise await self._run_finished(finished, after_seq)
        except RequestError as error:  # refused, fell too far behind, or the store went away
            await error.abort(context)
        except grpc.aio.AbortError:
            raise
        except Exception:
            await _internal_failure(context, "WatchRun")

    @staticmethod
    async def _run_finished(log: RunLog, after_seq: int) -> RunFinished:
        """The answer to a watcher asking for events after the end of ``log``."""
        outcome = ""
        if log.last_seq:
            last = log.follow(log.last_seq - 1)
            try:
                event = await anext(aiter(last))
                if event.HasField("result"):
                    outcome = events_pb2.Outcome.Name(event.result.outcome)
            finally:
                await last.aclose()  # type: ignore[attr-defined]
        return RunFinished(log.run_id, after_seq, log.last_seq, outcome)

    @_statuses
    async def CancelRun(self, request: Any, context: grpc.aio.ServicerContext
                        ) -> tool_service_pb2.CancelRunResponse:
        log = await self._visible_run(request.run_id, self.runtime.run_access.may_cancel)
        if log.finished:
            return tool_service_pb2.CancelRunResponse(cancelled=False)
        reason = request.reason[:500] or "cancelled by the caller"
        cancelled = await self.runtime.store.request_cancel(log.run_id, reason)
        if cancelled:
            # Its children in this process stop with it (Run.stop); those on other
            # replicas are found in its tree's index and asked to stop too.
            await cancel_subtree(self.runtime.store, log)
        return tool_service_pb2.CancelRunResponse(cancelled=cancelled)

    @_statuses
    async def SteerRun(self, request: Any, context: grpc.aio.ServicerContext
                       ) -> tool_service_pb2.SteerRunResponse:
        principal = current_principal.get()
        access = self.runtime.run_access
        check_steer_message(request.message, self.settings.steer_max_bytes)
        log = await self._visible_run(request.run_id, access.may_see_to_steer)
        if not access.may_steer(principal, log.owner):
            raise PermissionDenied("the caller may watch this run but not steer it",
                                   reason=_STEER_NOT_ALLOWED, metadata={"run_id": log.run_id})
        if log.finished:
            raise run_finished_error(log.run_id)
        await self.runtime.store.request_steer(log.run_id, request.message,
                                               f"principal {principal.describe()}")
        return tool_service_pb2.SteerRunResponse(run_id=log.run_id)

    @_statuses
    async def ListRuns(self, request: Any, context: grpc.aio.ServicerContext
                       ) -> tool_service_pb2.ListRunsResponse:
        principal = current_principal.get()
        state = request.state
        awaiting = state == tool_service_pb2.RUN_STATE_AWAITING_APPROVAL
        approvals = self.runtime.approvals
        # An approver lists every principal's runs that wait for approval.
        sees_all = self.runtime.run_access.sees_all_runs(principal) or (
            awaiting and principal.has_role(approvals.rules.approver_role))
        if request.page_size > MAX_RUNS_PAGE:
            raise InvalidArgument("page_size is too large", [FieldViolation(
                "page_size", f"at most {MAX_RUNS_PAGE}; 0 means {DEFAULT_RUNS_PAGE}")])
        for name in ("root_run_id", "parent_run_id"):
            if len(getattr(request, name)) > MAX_RUN_ID_CHARS:
                raise InvalidArgument(f"{name} is too long", [FieldViolation(
                    name, f"a run id: at most {MAX_RUN_ID_CHARS} characters")])
        if len(request.lane) > MAX_LANE_FILTER_CHARS:
            raise InvalidArgument("lane is too long", [FieldViolation(
                "lane", f"a lane name: at most {MAX_LANE_FILTER_CHARS} characters")])
        key = await self.runtime.store.page_token_key()
        query = RunQuery(
            owner=None if sees_all else principal.id,
            limit=request.page_size or DEFAULT_RUNS_PAGE,
            after=decode_page_token(request.page_token, key),
            tool=request.tool_name,
            finished=None if state == tool_service_pb2.RUN_STATE_UNSPECIFIED
            else state == tool_service_pb2.RUN_STATE_FINISHED,
            outcome=request.outcome, root_run_id=request.root_run_id,
            parent_run_id=request.parent_run_id, lane=request.lane)
        page = await self.runtime.store.list_runs(query)
        # Which of the page's unfinished runs wait for approval (one look for them all).
        records = await approvals.store.get_many(
            [run.run_id for run in page.runs if not run.finished])
        waiting = {run_id: record for run_id, record in records.items() if record.pending}
        runs = [self._with_phase(run_summary_message(run, with_principal=sees_all,
                                                     approval=waiting.get(run.run_id)))
                for run in page.runs]
        await self._with_queues_elsewhere(runs)
        if awaiting:
            runs = [run for run in runs if run.run_id in waiting]
        elif state in (tool_service_pb2.RUN_STATE_RUNNING, tool_service_pb2.RUN_STATE_QUEUED):
            # The store tells running from finished; a queued run (or one waiting for
            # approval) is one of its running ones (so a page of these may hold fewer than
            # page_size).
            runs = [run for run in runs if run.state == state and run.run_id not in waiting]
        return tool_service_pb2.ListRunsResponse(
            runs=runs, next_page_token=encode_page_token(page.cursor, key))

    async def _with_queues_elsewhere(self, runs: list[tool_service_pb2.RunSummary]) -> None:
        """Marks the runs of the page that wait in a lane of another replica (a fleet shares
        its lanes: their queues say)."""
        others = [run.run_id for run in runs if run.state == tool_service_pb2.RUN_STATE_RUNNING
                  and run.run_id not in self.runtime.runs]
        if not others:
            return
        waiting = await self.runtime.lanes.waiting(others)
        for run in runs:
            if run.run_id in waiting:
                run.lane, run.priority, run.queue_position = waiting[run.run_id]
                run.state = tool_service_pb2.RUN_STATE_QUEUED

    def _with_phase(self, message: tool_service_pb2.RunSummary) -> tool_service_pb2.RunSummary:
        """Adds what this replica knows of a run it holds: its lane and priority, and
        whether (and where) it waits in its lane's queue."""
        run = self.runtime.runs.get(message.run_id)
        if run is None or message.state == tool_service_pb2.RUN_STATE_FINISHED:
            return message
        message.lane, message.priority = run.lane, run.priority
        if run.phase == PHASE_QUEUED:
            message.state = tool_service_pb2.RUN_STATE_QUEUED
            place = self.runtime.lanes.where(run.run_id)
            if place is not None and not place.granted:
                message.queue_position = place.position
        return message

    @_statuses
    async def ApproveRun(self, request: Any, context: grpc.aio.ServicerContext
                         ) -> tool_service_pb2.ApproveRunResponse:
        principal = current_principal.get()
        check_decision(request.run_id, request.approval_id, request.decision, request.reason,
                       request.arguments_digest)
        approvals = self.runtime.approvals
        log = await self.runtime.store.open(request.run_id)
        # Its owner (and whoever may watch it) finds the run; an approver finds any run that
        # asked for approval. Anyone else is told it does not exist, as for an unknown run.
        if log is None or not (
                self.runtime.run_access.may_watch(principal, log.owner)
                or (principal.has_role(approvals.rules.approver_role)
                    and await approvals.store.get(log.run_id) is not None)):
            raise NotFound("unknown run (or expired, or not yours)", reason=_RUN_NOT_FOUND)
        decided = await approvals.decide(principal, log.owner, log.run_id, request.approval_id,
                                         request.decision, request.reason,
                                         request.arguments_digest, run_ended=log.finished)
        record = current_call.get()
        if record is not None:  # who, when (the record's time), what and why
            record.tool = decided.tool
            record.detail = (f"{decided.state} the run of {decided.principal} "
                             f"(arguments sha256 {decided.digest})"
                             + (f": {decided.reason}" if decided.reason else ""))
        return tool_service_pb2.ApproveRunResponse(
            run_id=log.run_id, decision=request.decision, arguments_digest=decided.digest)
    # -- sessions --------------------------------------------------------------------------

    @_statuses
    async def CreateSession(self, request: Any, context: grpc.aio.ServicerContext
                            ) -> tool_service_pb2.CreateSessionResponse:
        principal = current_principal.get()
        limits = self.sessions.grant(
            request.kind, ttl_seconds=request.ttl_seconds, idle_seconds=request.idle_seconds,
            memory_mb=request.memory_mb, cpu_seconds=request.cpu_seconds,
            disk_mb=request.disk_mb)
        # A session runs its kind's tool: the caller must be allowed to run it (shell is
        # privileged).
        self.runtime.policy.check(principal, self.runtime.lookup(request.kind))
        if self.runtime.draining:
            raise Unavailable("the server is shutting down; retry on another replica",
                              reason="DRAINING")
        session = await self.sessions.create(principal.id, request.kind, limits)
        return tool_service_pb2.CreateSessionResponse(session=session_message(session))

    @_statuses
    async def CloseSession(self, request: Any, context: grpc.aio.ServicerContext
                           ) -> tool_service_pb2.CloseSessionResponse:
        replica = await self._session_replica(request, context)
        if replica is not None:
            return await self._forward_unary(replica, "CloseSession", request,
                                             tool_service_pb2.CloseSessionResponse, context)
        session = await self.sessions.close(current_principal.get().id, request.session_id)
        return tool_service_pb2.CloseSessionResponse(session_id=session.session_id)

    @_statuses
    async def ListSessions(self, request: Any, context: grpc.aio.ServicerContext
                           ) -> tool_service_pb2.ListSessionsResponse:
        principal = current_principal.get()
        sessions = self.sessions.owned_by(principal.id)
        messages = [session_message(s) for s in sessions]
        if request.with_files:
            for session, message in zip(sessions, messages, strict=True):
                # In a thread: a folder of many entries must not stall the loop.
                files = await asyncio.to_thread(session.files, MAX_SESSION_FILES)
                message.files.extend(tool_service_pb2.SessionFile(name=name, size=size)
                                     for name, size in files)
        if self.forwarder is not None and not is_forwarded(
                context.invocation_metadata() or ()):
            here = {m.session_id for m in messages}
            elsewhere = await fleet_sessions(self.forwarder, request, principal, context,
                                             redis_timeout=self.settings.redis_timeout_seconds)
            messages.extend(m for m in elsewhere if m.session_id not in here)
            messages.sort(key=lambda m: (m.created_at.ToMilliseconds(), m.session_id))
        return tool_service_pb2.ListSessionsResponse(sessions=messages)

    async def _visible_run(self, run_id: str, allowed: Callable[[Principal, str], bool]
                           ) -> RunLog:
        """The log of ``run_id`` when ``allowed(caller, owner)`` (a :class:`RunAccess` rule).
        Anyone else is told NOT_FOUND, exactly as for an unknown run, so run ids of other
        principals cannot be probed.

        Raises:
            NotFound: Unknown, expired, or not the caller's.
            Unavailable: The shared run store cannot be reached.
        """
        log = await self.runtime.store.open(run_id) if run_id else None
        if log is not None and allowed(current_principal.get(), log.owner):
            return log
        raise NotFound("unknown run (or expired, or not yours)", reason=_RUN_NOT_FOUND)

    @property
    def settings(self) -> Settings:
        """The server's settings."""
        return self.runtime.settings


def tool_message(spec: ToolSpec) -> catalog_pb2.Tool:
    """The catalog entry of one tool."""
    message = catalog_pb2.Tool(name=spec.name, description=spec.description, kind=spec.kind,
                               categories=list(spec.categories))
    message.input_schema.update(spec.input_schema())
    output_schema = spec.output_schema()
    if output_schema is not None:
        message.output_schema.update(output_schema)
    annotations = spec.annotations
    message.annotations.read_only = annotations.read_only
    message.annotations.destructive = annotations.destructive
    message.annotations.idempotent = annotations.idempotent
    message.annotations.open_world = annotations.open_world
    message.permissions.privileged = spec.privileged
    message.permissions.allowed_roles.extend(spec.allowed_roles)
    return message


#: Files of one session ListSessions lists at most.
MAX_SESSION_FILES = 200

#: Longest ListRuns ``lane`` filter: a lane's name is at most this long (LANE_NAME_PATTERN).
MAX_LANE_FILTER_CHARS = 64

#: ListRuns page size when the request leaves it 0, and the largest allowed.
DEFAULT_RUNS_PAGE = 50
MAX_RUNS_PAGE = 200


def run_summary_message(run: RunSummary, *, with_principal: bool,
                        approval: ApprovalRecord | None = None
                        ) -> tool_service_pb2.RunSummary:
    """A run of a listing as the contract's RunSummary (``approval``: the pending request
    it waits on, if any)."""
    state = (tool_service_pb2.RUN_STATE_FINISHED if run.finished
             else tool_service_pb2.RUN_STATE_AWAITING_APPROVAL if approval is not None
             else tool_service_pb2.RUN_STATE_RUNNING)
    message = tool_service_pb2.RunSummary(
        run_id=run.run_id, tool_name=run.tool,
        principal=run.owner if with_principal else "",
        state=state,
        outcome=events_pb2.Outcome.Name(run.outcome), last_seq=run.last_seq,
        current_step=run.current_step, parent_run_id=run.parent_run_id,
        root_run_id=run.tree_root, depth=run.depth, lane=run.lane, priority=run.priority)
    message.started_at.FromMilliseconds(run.started_ms)
    if run.ended_ms:
        message.ended_at.FromMilliseconds(run.ended_ms)
    if approval is not None:
        fill_request(message.approval, approval)
    return message


def session_message(session: Session) -> tool_service_pb2.Session:
    """A session as the contract's Session."""
    limits, usage = session.limits, session.usage
    message = tool_service_pb2.Session(
        session_id=session.session_id, kind=session.kind,
        idle_seconds=int(limits.idle_seconds), memory_mb=limits.memory_mb,
        cpu_seconds=limits.cpu_seconds, disk_mb=limits.disk_mb, calls=session.calls,
        busy=session.busy)
    message.created_at.FromMilliseconds(int(session.created_at * 1000))
    message.expires_at.FromMilliseconds(int(session.expires_at * 1000))
    message.last_used_at.FromMilliseconds(int(session.last_used_at * 1000))
    message.usage.wall_seconds = usage.wall_seconds
    message.usage.cpu_user_seconds = usage.cpu_user_seconds
    message.usage.cpu_system_seconds = usage.cpu_system_seconds
    if usage.peak_rss_bytes is not None:
        message.usage.peak_rss_bytes = usage.peak_rss_bytes
    if usage.disk_bytes is not None:
        message.usage.bytes_written = usage.disk_bytes
    return message


def add_to_server(service: ToolService, server: grpc.aio.Server) -> None:
    """Registers ``service`` on ``server`` with request decoding that tolerates bad bytes,
    and response encoding that sends pre-serialised events as they are.

    Every method of the contract's ToolService is served, each with the request type and
    call shape the contract gives it: a method the contract gains and ``service`` lacks
    stops start-up here (AttributeError), rather than answering UNIMPLEMENTED later.
    """
    handlers = {}
    for method in tool_service_pb2.DESCRIPTOR.services_by_name["ToolService"].methods:
        # The contract has unary and server-streaming methods only.
        assert not method.client_streaming, method.full_name
        handler = (grpc.unary_stream_rpc_method_handler if method.server_streaming
                   else grpc.unary_unary_rpc_method_handler)
        request_type = getattr(tool_service_pb2, method.input_type.name)
        handlers[method.name] = handler(getattr(service, method.name),
                                        _tolerant(request_type), serialize_response)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
