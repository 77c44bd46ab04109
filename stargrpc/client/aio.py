"""The asyncio client: :class:`AsyncClient`.

What it does for every caller, so none re-implements it:

- **credentials**: an API key or JWT as ``authorization: Bearer …`` on every call;
- **an idempotency key per call**, generated when not given, and kept across retries;
- **retries** with exponential backoff on UNAVAILABLE (and on RESOURCE_EXHAUSTED when the
  server says when to come back); a server's ``google.rpc.RetryInfo`` delay is honoured;
- **CATALOG_STALE**: when the caller planned with an old catalog, reload it and retry once;
- **resume**: a stream that breaks after the run started is resumed with WatchRun from the
  last ``seq`` seen, so the caller sees every event exactly once, in order.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import grpc
from google.protobuf import json_format

from stargrpc.client.channel import bearer_metadata, open_channel
from stargrpc.client.errors import CallError, ResumeError
from stargrpc.client.events import Catalog, Event, Result, ToolInfo, event_from_proto
from stargrpc.client.retry import NO_RETRY, RESUMABLE, RetryPolicy
from stargrpc.contract import reason_name
from stargrpc.v1 import (
    errors_pb2,
    state_pb2,
    state_pb2_grpc,
    tool_service_pb2,
    tool_service_pb2_grpc,
)

T = TypeVar("T")

_CATALOG_STALE = reason_name(errors_pb2.CATALOG_STALE)
_RUN_FINISHED = reason_name(errors_pb2.RUN_FINISHED)

Metadata = Sequence[tuple[str, str]]

#: An ``InvocationContext`` as a message or as a dict with its field names
#: (``end_user``, ``channel``, ``trace_id``, ``session_id``, ``labels``).
InvocationContext = tool_service_pb2.InvocationContext | Mapping[str, Any]


class _Deadline:
    """The caller's overall timeout, shared by every attempt of one operation."""

    def __init__(self, timeout: float | None) -> None:
        self.at = None if timeout is None else time.monotonic() + timeout

    def remaining(self) -> float | None:
        """Seconds left; raises once none are."""
        if self.at is None:
            return None
        left = self.at - time.monotonic()
        if left <= 0:
            raise CallError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
        return left

    async def sleep(self, delay: float, error: CallError) -> None:
        """Waits ``delay`` seconds, or raises ``error`` when the deadline comes first."""
        left = self.remaining()
        if left is not None and delay >= left:
            raise error
        await asyncio.sleep(delay)


@dataclass
class _Cursor:
    """Where a caller is in one run's event log."""

    run_id: str = ""
    last_seq: int = 0
    finished: bool = False


class AsyncClient:
    """An asyncio client of a stargrpc server.

    Example::

        async with AsyncClient.connect("localhost:50051", api_key=key) as client:
            async for event in client.execute("count", {"to": 3}):
                print(event)
            result = await client.call("echo", {"text": "hi"})

    Args:
        channel: A grpc.aio channel to the server (injected: the client does not close it
            unless ``own_channel`` is set).
        api_key: An API key, sent as ``authorization: Bearer …``.
        token: A JWT, sent the same way (give one of the two).
        metadata: Extra metadata sent with every call.
        retry: When to retry and how long to wait.
        own_channel: Close the channel in :meth:`close`.

    Attributes:
        catalog: The last catalog loaded with :meth:`list_tools`. While it is set, Execute
            sends its hash, and a CATALOG_STALE refusal reloads it and retries once.
    """

    catalog: Catalog | None

    def __init__(self, channel: grpc.aio.Channel, *, api_key: str | None = None,
                 token: str | None = None, metadata: Metadata = (),
                 retry: RetryPolicy | None = None, own_channel: bool = False) -> None:
        self._metadata = (*bearer_metadata(api_key, token), *metadata)
        self._channel = channel
        self._stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        self._state_stub = state_pb2_grpc.RunStateServiceStub(channel)
        self._retry = retry if retry is not None else RetryPolicy()
        self._own_channel = own_channel
        self.catalog = None

    @classmethod
    def connect(cls, target: str, *, api_key: str | None = None, token: str | None = None,
                tls: bool = False, ca_file: str | Path | None = None,
                cert_file: str | Path | None = None, key_file: str | Path | None = None,
                metadata: Metadata = (), retry: RetryPolicy | None = None,
                options: Sequence[tuple[str, Any]] = ()) -> AsyncClient:
        """A client on a channel of its own to ``target`` (closed by :meth:`close`).

        Args:
            target: ``host:port``.
            api_key: An API key (or ``token``: a JWT).
            tls: Use TLS with the system's root certificates (or ``ca_file``).
            ca_file: PEM roots to verify the server with; implies TLS.
            cert_file: A client certificate (PEM) for mutual TLS, with ``key_file``.
            key_file: The client certificate's private key (PEM).
            metadata: Extra metadata for every call.
            retry: The retry policy.
            options: Extra grpc channel options.
        """
        channel = open_channel(target, tls=tls, ca_file=ca_file, cert_file=cert_file,
                               key_file=key_file, options=options)
        return cls(channel, api_key=api_key, token=token, metadata=metadata, retry=retry,
                   own_channel=True)

    async def close(self) -> None:
        """Closes the channel if the client opened it."""
        if self._own_channel:
            await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    def _call_metadata(self, extra: Metadata | None) -> tuple[tuple[str, str], ...]:
        return (*self._metadata, *(extra or ()))

    async def _unary(self, send: Callable[[float | None], Awaitable[T]],
                     timeout: float | None,  # noqa: ASYNC109 (a gRPC deadline)
                     retry: RetryPolicy | None = None) -> T:
        """One unary call with the retry policy applied (``retry``, else the client's)."""
        policy = retry if retry is not None else self._retry
        deadline = _Deadline(timeout)
        attempt = 0
        while True:
            attempt += 1
            try:
                return await send(deadline.remaining())
            except grpc.aio.AioRpcError as exc:
                error = CallError.from_rpc_error(exc)
            delay = (policy.delay(attempt, error)
                     if policy.should_retry_call(error) else None)
            if delay is None:
                raise error
            await deadline.sleep(delay, error)

    # -- catalog ---------------------------------------------------------------------------

    async def list_tools(self, *, timeout: float | None = None,  # noqa: ASYNC109
                         metadata: Metadata | None = None) -> Catalog:
        """The tools the caller may see, with the catalog hash; kept as :attr:`catalog`.

        Raises:
            CallError: The server refused the call.
        """
        known = self.catalog.catalog_hash if self.catalog is not None else ""
        reply = await self._unary(
            lambda left: self._stub.ListTools(
                tool_service_pb2.ListToolsRequest(known_catalog_hash=known),
                metadata=self._call_metadata(metadata), timeout=left),
            timeout)
        if reply.not_modified and self.catalog is not None:
            return self.catalog
        self.catalog = Catalog(tools=[ToolInfo.from_proto(t) for t in reply.tools],
                               catalog_hash=reply.catalog_hash)
        return self.catalog

    async def watch_catalog(self, *, metadata: Metadata | None = None
                            ) -> AsyncIterator[Catalog]:
        """The current catalog (unless :attr:`catalog` is already current), then each new
        one as the server's tools change; each is kept as :attr:`catalog`. Runs until the
        caller stops iterating; a broken stream is reopened with the retry policy.

        Raises:
            CallError: The server refused the call, or kept failing.
        """
        attempt = 0
        while True:
            attempt += 1
            known = self.catalog.catalog_hash if self.catalog is not None else ""
            call = self._stub.WatchCatalog(
                tool_service_pb2.WatchCatalogRequest(known_catalog_hash=known),
                metadata=self._call_metadata(metadata))
            try:
                async for reply in call:
                    attempt = 0
                    self.catalog = Catalog(tools=[ToolInfo.from_proto(t) for t in reply.tools],
                                           catalog_hash=reply.catalog_hash)
                    yield self.catalog
                error = CallError(grpc.StatusCode.UNAVAILABLE, "the catalog stream ended")
            except grpc.aio.AioRpcError as exc:
                error = CallError.from_rpc_error(exc)
            finally:
                call.cancel()
            delay = self._retry.delay(attempt, error) if error.code in RESUMABLE else None
            if delay is None:
                raise error
            await asyncio.sleep(delay)

    # -- runs ------------------------------------------------------------------------------

    async def execute(self, tool: str, arguments: Mapping[str, Any] | str | None = None, *,
                      idempotency_key: str | None = None, catalog_hash: str | None = None,
                      context: InvocationContext | None = None,
                      parent_run_id: str = "",
                      timeout: float | None = None,  # noqa: ASYNC109 (a gRPC deadline)
                      metadata: Metadata | None = None, session_id: str | None = None,
                      session_no_wait: bool = False, lane: str = "", priority: int = 0,
                      max_wait_seconds: float = 0.0) -> AsyncIterator[Event]:
        """Runs a tool and yields its events as they happen; the last one is the Result.

        Args:
            tool: The tool's name.
            arguments: A JSON-ready mapping, or raw JSON text (kept as written, for exact
                numbers).
            idempotency_key: Repeating a key attaches to (or replays) the first run instead
                of running the tool again; one is generated when not given.
            catalog_hash: The catalog hash the caller planned with; defaults to that of
                :attr:`catalog` when one was loaded. Empty skips the check.
            context: The invocation context (end user, channel, trace id, labels).
            parent_run_id: Hang the run under this run of the caller's own (a call tree
                an agent started); its events then carry it, and it is cancelled with it.
            timeout: Seconds for the whole call, retries and resumes included.
            metadata: Extra metadata for this call.
            session_id: Run in this session (:meth:`create_session`): ``python`` or
                ``shell`` in its sandbox, with its files and live interpreter.
            session_no_wait: With ``session_id``, be refused (SESSION_BUSY) rather than
                wait while the session runs another call.
            lane: Run in this lane instead of the tool's (needs the server's
                ``lane_override_role``).
            priority: Priority in the lane's queue (0: the tool's or lane's default).
            max_wait_seconds: Refuse at once (``LANE_BUSY``) rather than wait longer than
                this in the lane's queue; 0 waits.

        Yields:
            Typed events, each exactly once and in ``seq`` order, ending with a
            :class:`Result`; a run that waits for its lane first yields ``Notice`` events
            with code ``QUEUED`` (:attr:`Notice.queued` says where it waits).

        Raises:
            CallError: The call was refused before the run started (and retrying did not
                help), or the deadline passed.
            ResumeError: The stream broke and the run could not be resumed without a gap.

        Leaving the iteration early closes the stream but does not stop the run (it has an
        idempotency key, so the server keeps it for WatchRun); call :meth:`cancel` for that.
        """
        request = tool_service_pb2.ExecuteRequest(
            tool_name=tool, idempotency_key=idempotency_key or uuid.uuid4().hex,
            parent_run_id=parent_run_id, session_id=session_id or "",
            session_no_wait=session_no_wait, lane=lane, priority=priority,
            max_wait_seconds=max_wait_seconds)
        if isinstance(arguments, str):
            request.arguments_json = arguments
        elif arguments is not None:
            request.arguments_json = json.dumps(dict(arguments))
        if context is not None:
            if isinstance(context, tool_service_pb2.InvocationContext):
                request.context.CopyFrom(context)
            else:
                json_format.ParseDict(dict(context), request.context)
        if catalog_hash is None and self.catalog is not None:
            catalog_hash = self.catalog.catalog_hash
        request.catalog_hash = catalog_hash or ""
        call_metadata = self._call_metadata(metadata)
        deadline = _Deadline(timeout)
        cursor = _Cursor()
        attempt = 0
        reloaded = False
        while True:
            attempt += 1
            call = self._stub.Execute(request, metadata=call_metadata,
                                      timeout=deadline.remaining())
            error: CallError | None = None
            try:
                async for event in self._read(call, cursor):
                    attempt = 0
                    yield event
            except grpc.aio.AioRpcError as exc:
                error = CallError.from_rpc_error(exc)
            if cursor.finished:
                return
            if cursor.run_id:  # the run started: never run it again, resume it
                if error is not None and error.code not in RESUMABLE:
                    raise error
                async for event in self._follow(cursor, deadline, call_metadata):
                    yield event
                return
            if error is None:
                error = CallError(grpc.StatusCode.UNAVAILABLE,
                                  "the stream ended before the run started")
            if (error.reason == _CATALOG_STALE and request.catalog_hash and not reloaded):
                reloaded = True
                fresh = await self.list_tools(timeout=deadline.remaining(), metadata=metadata)
                request.catalog_hash = fresh.catalog_hash
                attempt -= 1  # the reload is not a failed try
                continue
            delay = (self._retry.delay(attempt, error)
                     if self._retry.should_retry_call(error) else None)
            if delay is None:
                raise error
            await deadline.sleep(delay, error)

    async def call(self, tool: str, arguments: Mapping[str, Any] | str | None = None, *,
                   on_event: Callable[[Event], object] | None = None,
                   **options: Any) -> Result:
        """Runs a tool and returns just its Result (every event passes ``on_event`` first).

        Takes the same options as :meth:`execute`. A run that ends badly is a Result with
        that outcome, not an exception; see :meth:`Result.raise_for_outcome`.
        """
        async for event in self.execute(tool, arguments, **options):
            if on_event is not None:
                on_event(event)
            if isinstance(event, Result):
                return event
        raise AssertionError("execute() always ends with a Result")  # pragma: no cover

    async def watch(self, run_id: str, after_seq: int = 0, *,
                    timeout: float | None = None,  # noqa: ASYNC109 (a gRPC deadline)
                    metadata: Metadata | None = None) -> AsyncIterator[Event]:
        """Replays a run's events after ``after_seq``, then follows it until its Result.
        A broken stream is resumed, as with :meth:`execute`.

        When the run has already ended at or before ``after_seq`` there is nothing to
        replay: the iteration ends at once, with no events (the server answers such a
        WatchRun with OUT_OF_RANGE, reason ``RUN_FINISHED``).

        Raises:
            CallError: The run is unknown (NOT_FOUND), not the caller's, or the deadline
                passed.
            ResumeError: The stream broke and could not be resumed without a gap.
        """
        cursor = _Cursor(run_id=run_id, last_seq=after_seq)
        async for event in self._follow(cursor, _Deadline(timeout),
                                        self._call_metadata(metadata), first=True):
            yield event

    async def cancel(self, run_id: str, reason: str = "", *,
                     timeout: float | None = None,  # noqa: ASYNC109 (a gRPC deadline)
                     metadata: Metadata | None = None) -> bool:
        """Asks a run to stop; it ends with Result{CANCELLED} and ``reason``.

        Returns:
            Whether the run was still going (False: it had already ended).

        Raises:
            CallError: Unknown run, or not the caller's.
        """
        reply = await self._unary(
            lambda left: self._stub.CancelRun(
                tool_service_pb2.CancelRunRequest(run_id=run_id, reason=reason),
                metadata=self._call_metadata(metadata), timeout=left),
            timeout)
        return bool(reply.cancelled)

    async def steer(self, run_id: str, message: str, *,
                    timeout: float | None = None,  # noqa: ASYNC109 (a gRPC deadline)
                    metadata: Metadata | None = None) -> None:
        """Sends a steering message to a running tool (SteerRun).

        Sent once, never retried (whatever the retry policy): a message sent again after an
        UNAVAILABLE the server had in fact acted on would reach the tool twice. The caller,
        who knows whether a repeat does harm, decides.

        Raises:
            CallError: Unknown run or not the caller's (NOT_FOUND), the run has ended
                (FAILED_PRECONDITION), the message is empty or too long
                (INVALID_ARGUMENT), too many unread messages (RESOURCE_EXHAUSTED).
        """
        await self._unary(
            lambda left: self._stub.SteerRun(
                tool_service_pb2.SteerRunRequest(run_id=run_id, message=message),
                metadata=self._call_metadata(metadata), timeout=left),
            timeout, retry=NO_RETRY)

    async def approve(self, run_id: str, approval_id: str, *, reason: str = "",
                      arguments_digest: str = "", deny: bool = False,
                      timeout: float | None = None,  # noqa: ASYNC109 (a gRPC deadline)
                      metadata: Metadata | None = None) -> tool_service_pb2.ApproveRunResponse:
        """Approves (or, with ``deny``, denies) a run that waits for approval (ApproveRun);
        the caller needs the server's approver role.

        Sent once, never retried by the client: a decision is taken once. Sending the same
        decision again (its answer lost) gets the same answer; another one is refused
        APPROVAL_NOT_PENDING.

        Args:
            run_id: The waiting run.
            approval_id: Its ApprovalRequest.approval_id (the APPROVAL_REQUIRED notice, or
                ListRuns state ``"awaiting_approval"``).
            reason: Why; a denied run's Result carries it.
            arguments_digest: The ApprovalRequest.arguments_digest the decision is for:
                refused when the run's arguments are not those.
            deny: Deny instead of approve.

        Raises:
            CallError: Refused — no role (PERMISSION_DENIED, APPROVER_ROLE_REQUIRED), the
                caller's own run, another approval id, other arguments, a run that does not
                wait, an unknown run (NOT_FOUND), a malformed field (INVALID_ARGUMENT).
        """
        request = tool_service_pb2.ApproveRunRequest(
            run_id=run_id, approval_id=approval_id, reason=reason,
            arguments_digest=arguments_digest,
            decision=tool_service_pb2.APPROVAL_VERDICT_DENY if deny
            else tool_service_pb2.APPROVAL_VERDICT_APPROVE)
        reply: tool_service_pb2.ApproveRunResponse = await self._unary(
            lambda left: self._stub.ApproveRun(
                request, metadata=self._call_metadata(metadata), timeout=left),
            timeout, retry=NO_RETRY)
        return reply

    async def create_session(self, kind: str = "python", *, ttl_seconds: int = 0,
                             idle_seconds: int = 0, memory_mb: int = 0, cpu_seconds: int = 0,
                             disk_mb: int = 0,
                             timeout: float | None = None,  # noqa: ASYNC109 (a gRPC deadline)
                             metadata: Metadata | None = None) -> tool_service_pb2.Session:
        """Opens a session (CreateSession): a sandbox kept for the caller across calls.

        Sent once, never retried: a request repeated after an UNAVAILABLE the server had in
        fact served would open a second session.

        Args:
            kind: ``"python"`` (a live interpreter) or ``"shell"``.
            ttl_seconds: Longest life (0: the server's).
            idle_seconds: Longest time without a call (0: the server's).
            memory_mb: Address space of each process (0: the server's).
            cpu_seconds: CPU seconds of each process over the session's life (0: the
                server's).
            disk_mb: Disk its folder may hold (0: the server's).

        Returns:
            The session; pass its ``session_id`` to :meth:`execute` or :meth:`call`.

        Raises:
            CallError: An unknown kind or a limit above the server's (INVALID_ARGUMENT),
                too many sessions (RESOURCE_EXHAUSTED, SESSION_LIMIT).
        """
        request = tool_service_pb2.CreateSessionRequest(
            kind=kind, ttl_seconds=ttl_seconds, idle_seconds=idle_seconds,
            memory_mb=memory_mb, cpu_seconds=cpu_seconds, disk_mb=disk_mb)
        reply: tool_service_pb2.CreateSessionResponse = await self._unary(
            lambda left: self._stub.CreateSession(
                request, metadata=self._call_metadata(metadata), timeout=left),
            timeout, retry=NO_RETRY)
        return reply.session

    async def close_session(self, session_id: str, *,
                            timeout: float | None = None,  # noqa: ASYNC109 (a gRPC deadline)
                            metadata: Metadata | None = None) -> None:
        """Closes one of the caller's sessions (CloseSession); its files are gone.

        Raises:
            CallError: Unknown, expired or not the caller's (NOT_FOUND, SESSION_NOT_FOUND).
        """
        await self._unary(
            lambda left: self._stub.CloseSession(
                tool_service_pb2.CloseSessionRequest(session_id=session_id),
                metadata=self._call_metadata(metadata), timeout=left),
            timeout, retry=NO_RETRY)

    async def list_sessions(self, *,
                            timeout: float | None = None,  # noqa: ASYNC109 (a gRPC deadline)
                            metadata: Metadata | None = None
                            ) -> list[tool_service_pb2.Session]:
        """The caller's open sessions, oldest first, with what each used (ListSessions)."""
        reply: tool_service_pb2.ListSessionsResponse = await self._unary(
            lambda left: self._stub.ListSessions(
                tool_service_pb2.ListSessionsRequest(),
                metadata=self._call_metadata(metadata), timeout=left),
            timeout)
        return list(reply.sessions)

    async def list_runs(self, *, tool: str = "", state: str = "", outcome: str = "",
                        root_run_id: str = "", parent_run_id: str = "", lane: str = "",
                        page_size: int = 0, page_token: str = "",
                        timeout: float | None = None,  # noqa: ASYNC109 (a gRPC deadline)
                        metadata: Metadata | None = None) -> tool_service_pb2.ListRunsResponse:
        """One page of the runs the caller may see, newest first (ListRuns).

        Args:
            tool: Only runs of this tool.
            state: Only ``"running"``, ``"finished"`` or ``"awaiting_approval"`` runs;
                empty for all.
            outcome: Only runs that ended so, by Outcome name (``"OK"``, ``"FAILED"``, …).
            root_run_id: Only the runs of this call tree (its root included).
            parent_run_id: Only the runs this run started.
            lane: Only the runs of this lane (queued, running or finished).
            page_size: Most runs in the page (0: the server's default).
            page_token: ``next_page_token`` of the previous page.

        Returns:
            The page; its ``next_page_token`` is empty when no run is left.

        Raises:
            ValueError: ``state`` or ``outcome`` is not a known name.
            CallError: The server refused the call (such as a bad page token).
        """
        request = tool_service_pb2.ListRunsRequest(
            tool_name=tool, page_size=page_size, page_token=page_token,
            root_run_id=root_run_id, parent_run_id=parent_run_id, lane=lane,
            state=f"RUN_STATE_{state.upper()}" if state else None,
            outcome=f"OUTCOME_{outcome.upper()}" if outcome else None)
        reply: tool_service_pb2.ListRunsResponse = await self._unary(
            lambda left: self._stub.ListRuns(
                request, metadata=self._call_metadata(metadata), timeout=left),
            timeout)
        return reply

    # -- run state (RunStateService: the admin role) ----------------------------------------

    async def get_state(self, scope: str, key: str, default: Any = None, *, run_id: str = "",
                        principal: str = "",
                        timeout: float | None = None,  # noqa: ASYNC109 (a gRPC deadline)
                        metadata: Metadata | None = None) -> Any:
        """The value of ``key`` in a scope of run state, or ``default`` when absent (admin
        role).

        Args:
            scope: ``run``, ``tree``, ``principal`` or ``global``.
            key: The key.
            default: What an absent key gives.
            run_id: The run (scope run) or the tree's root run (scope tree).
            principal: The principal's id (scope principal).

        Raises:
            CallError: Not an admin (PERMISSION_DENIED), a bad scope or key
                (INVALID_ARGUMENT), the store is down (UNAVAILABLE).
        """
        request = state_pb2.GetStateRequest(scope=_state_scope(scope, run_id, principal),
                                            key=key)
        reply = await self._unary(
            lambda left: self._state_stub.GetState(
                request, metadata=self._call_metadata(metadata), timeout=left), timeout)
        return json.loads(reply.value_json) if reply.found else default

    async def set_state(self, scope: str, key: str, value: Any, *, ttl: float | None = None,
                        run_id: str = "", principal: str = "",
                        timeout: float | None = None,  # noqa: ASYNC109 (a gRPC deadline)
                        metadata: Metadata | None = None) -> None:
        """Sets ``key`` to ``value`` (JSON) in a scope of run state, for ``ttl`` seconds
        (None: as long as the scope); admin role. See :meth:`get_state` for the scope.

        Raises:
            CallError: As :meth:`get_state`; RESOURCE_EXHAUSTED over the scope's quota.
            TypeError, ValueError: ``value`` is not JSON.
        """
        request = state_pb2.SetStateRequest(
            scope=_state_scope(scope, run_id, principal), key=key,
            value_json=json.dumps(value, allow_nan=False), ttl_seconds=ttl or 0.0)
        await self._unary(
            lambda left: self._state_stub.SetState(
                request, metadata=self._call_metadata(metadata), timeout=left), timeout)

    async def delete_state(self, scope: str, key: str, *, run_id: str = "",
                           principal: str = "",
                           timeout: float | None = None,  # noqa: ASYNC109 (a gRPC deadline)
                           metadata: Metadata | None = None) -> bool:
        """Removes ``key`` from a scope of run state; whether it was there (admin role).
        Sent once, never retried: a delete whose reply was lost would be retried into "it
        was not there".

        Raises:
            CallError: As :meth:`get_state`.
        """
        request = state_pb2.DeleteStateRequest(scope=_state_scope(scope, run_id, principal),
                                               key=key)
        reply = await self._unary(
            lambda left: self._state_stub.DeleteState(
                request, metadata=self._call_metadata(metadata), timeout=left), timeout,
            retry=NO_RETRY)
        return bool(reply.deleted)

    async def list_state(self, scope: str, *, prefix: str = "", run_id: str = "",
                         principal: str = "", page_size: int = 0, after_key: str = "",
                         with_values: bool = False,
                         timeout: float | None = None,  # noqa: ASYNC109 (a gRPC deadline)
                         metadata: Metadata | None = None) -> state_pb2.ListStateResponse:
        """One page of the keys of a scope of run state, sorted (admin role).

        Args:
            prefix: Only keys starting with it.
            page_size: Most entries (0: the server's default).
            after_key: The previous page's ``next_after_key``.
            with_values: Return each value (``value_json``) too.

        Raises:
            CallError: As :meth:`get_state`.
        """
        request = state_pb2.ListStateRequest(
            scope=_state_scope(scope, run_id, principal), prefix=prefix,
            page_size=page_size, after_key=after_key, with_values=with_values)
        reply: state_pb2.ListStateResponse = await self._unary(
            lambda left: self._state_stub.ListState(
                request, metadata=self._call_metadata(metadata), timeout=left), timeout)
        return reply

    # -- streams ---------------------------------------------------------------------------

    async def _read(self, call: Any, cursor: _Cursor) -> AsyncIterator[Event]:
        """The new events of one stream: what the cursor has seen is skipped (an attach
        replays from seq 1), a gap is an error, and the call ends with the Result."""
        try:
            async for response in call:
                raw = response.event
                if cursor.run_id and raw.run_id != cursor.run_id:
                    raise ResumeError(f"the server switched from run {cursor.run_id} to "
                                      f"{raw.run_id}", run_id=cursor.run_id,
                                      last_seq=cursor.last_seq)
                if raw.seq <= cursor.last_seq:
                    continue
                if raw.seq != cursor.last_seq + 1:
                    raise ResumeError(f"events {cursor.last_seq + 1}..{raw.seq - 1} of run "
                                      f"{raw.run_id} are missing", run_id=raw.run_id,
                                      last_seq=cursor.last_seq)
                cursor.run_id, cursor.last_seq = raw.run_id, raw.seq
                event = event_from_proto(raw)
                cursor.finished = isinstance(event, Result)
                yield event
                if cursor.finished:
                    return
        finally:
            call.cancel()

    async def _follow(self, cursor: _Cursor, deadline: _Deadline, metadata: Metadata,
                      *, first: bool = False) -> AsyncIterator[Event]:
        """WatchRun from the cursor until the Result, resuming as often as the retry policy
        allows in a row (any delivered event resets the count)."""
        attempt = 0
        while True:
            attempt += 1
            call = self._stub.WatchRun(
                tool_service_pb2.WatchRunRequest(run_id=cursor.run_id,
                                                 after_seq=cursor.last_seq),
                metadata=metadata, timeout=deadline.remaining())
            try:
                async for event in self._read(call, cursor):
                    attempt, first = 0, False
                    yield event
                if cursor.finished:
                    return
                error = CallError(grpc.StatusCode.UNAVAILABLE,
                                  "the stream ended before the run's Result")
            except grpc.aio.AioRpcError as exc:
                error = CallError.from_rpc_error(exc)
            if error.reason == _RUN_FINISHED and _ended_by(error) <= cursor.last_seq:
                cursor.finished = True  # the run ended at or before what the caller has seen
                return
            if error.code not in RESUMABLE:
                if first or error.code is not grpc.StatusCode.NOT_FOUND:
                    raise error
                raise ResumeError(f"run {cursor.run_id} can no longer be watched: "
                                  f"{error.message}", run_id=cursor.run_id,
                                  last_seq=cursor.last_seq) from error
            delay = self._retry.delay(attempt, error)
            if delay is None:
                raise ResumeError(f"run {cursor.run_id} could not be resumed after "
                                  f"{attempt} tries: {error}", run_id=cursor.run_id,
                                  last_seq=cursor.last_seq) from error
            await deadline.sleep(delay, error)


def _ended_by(error: CallError) -> int:
    """The seq of the Result a RUN_FINISHED answer names (its ErrorInfo ``last_seq``); one
    that names none counts as never seen, so it is not taken for the end."""
    try:
        return int(error.metadata.get("last_seq", ""))
    except ValueError:
        return 2**64


def _state_scope(scope: str, run_id: str, principal: str) -> state_pb2.StateScopeRef:
    """The scope reference of a run state call.

    Raises:
        ValueError: ``scope`` is not run, tree, principal or global.
    """
    try:
        number = state_pb2.StateScope.Value(f"STATE_SCOPE_{scope.upper()}")
    except ValueError:
        raise ValueError(f"no state scope {scope!r}: run, tree, principal or global") \
            from None
    return state_pb2.StateScopeRef(scope=number, run_id=run_id, principal=principal)
