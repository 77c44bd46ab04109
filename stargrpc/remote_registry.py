"""A tool registry for agent runtimes that moves tools out of process without code changes.

:class:`RemoteToolRegistry` gives an agent runtime one ``call()`` whatever runs the tool:

- ``mode="in_process"``: every call runs on the runtime's own :class:`~stargrpc.registry.Registry`
  (the same tool modules the server loads), through the server's own run pipeline
  (:class:`~stargrpc.runs.runtime.Runtime`: argument validation, the permission policy, the
  critic's supervision, the run's event log), with nothing to connect to;
- ``mode="remote"``: calls go to a stargrpc server through
  :class:`~stargrpc.client.aio.AsyncClient` (idempotency keys, retries, resume, stale
  catalog reloaded once), except the tools named in ``tools_force_in_process``, which always
  run locally.

In remote mode the registry keeps the server's catalog. A tool the catalog marks not
callable for this caller fails at once with ``PERMISSION_DENIED`` (reason
``TOOL_NOT_ALLOWED``), without a call; the server still checks every call itself.

**Local fallback.** When the server cannot be reached and the tool is also held locally,
the call runs in process instead — but only when the failure proves the tool did not run
remotely: ``UNAVAILABLE`` before any event (the client has already retried with the same
idempotency key, which would have attached to a run the server had started), or a
channel that did not connect within ``connect_timeout``. The caller's own deadline is
never a fallback: once it has passed, nothing runs. Once any
event of the remote run has arrived, a failure is the caller's (``ResumeError`` or
``CallError``): the tool is never run twice. Refusals (``PERMISSION_DENIED``,
``INVALID_ARGUMENT``, …) and Results of any outcome are answers, never fallbacks.

Every fallback is logged (``tool_fallback``, WARNING); every local run is audited: an
:class:`~stargrpc.audit.AuditRecord` whose ``method`` is :data:`FALLBACK_METHOD` or
:data:`IN_PROCESS_METHOD` and whose ``peer`` is ``local``, logged (``local_audit``) and
appended to ``audit_store`` when one is given (``stargrpc audit --method LocalFallback``
then lists the fallbacks).

Write-back channels (sent files, injected tools, rich messages) come back on the
:class:`~stargrpc.client.events.Result` in both modes, and are appended to the caller's
``into=`` object the same way; files that travelled as chunks are put back together first.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Protocol

import grpc
import structlog

from stargrpc.audit.record import AuditRecord, outcome_for_result, outcome_for_status, utc_now
from stargrpc.audit.redact import cut
from stargrpc.audit.store import AuditStore
from stargrpc.audit.view import AuditLimits
from stargrpc.client._files import StreamedFiles
from stargrpc.client.aio import AsyncClient, InvocationContext, Metadata
from stargrpc.client.channel import open_channel
from stargrpc.client.errors import CallError, Violation
from stargrpc.client.events import (
    Catalog,
    Event,
    FileChunk,
    InjectedTool,
    Result,
    RichMessage,
    SentFile,
    event_from_proto,
)
from stargrpc.client.retry import RetryPolicy
from stargrpc.critic.supervision import SupervisionPolicy
from stargrpc.errors import InvalidArgument, RequestError, ResourceExhausted, Unavailable
from stargrpc.ids import new_id
from stargrpc.principal import Principal
from stargrpc.registry import Registry
from stargrpc.runs.arguments import decode_json
from stargrpc.runs.event_sizes import cut_notice
from stargrpc.runs.outcome import Outcome
from stargrpc.runs.permissions import RolePolicy, ToolPolicy
from stargrpc.runs.run import Run
from stargrpc.runs.runtime import RunRequest, Runtime
from stargrpc.settings import Settings
from stargrpc.v1 import events_pb2

_log = structlog.get_logger("stargrpc.remote_registry")

__all__ = [
    "FALLBACK_METHOD",
    "IN_PROCESS_METHOD",
    "LOCAL_PRINCIPAL",
    "CollectedWriteBack",
    "Mode",
    "RemoteToolRegistry",
    "WriteBackTarget",
]

#: Where calls go: all to the local registry, or to the server.
Mode = Literal["in_process", "remote"]

#: The audit ``method`` of a call that fell back to the local registry.
FALLBACK_METHOD = "/stargrpc.client.RemoteToolRegistry/LocalFallback"
#: The audit ``method`` of a call the registry ran locally by choice (mode or pinning).
IN_PROCESS_METHOD = "/stargrpc.client.RemoteToolRegistry/InProcess"

#: Who local runs execute as unless the registry is given a principal: no roles, so the
#: local policy admits it to ordinary tools and not to privileged ones.
LOCAL_PRINCIPAL = Principal(id="local", method="local")


class WriteBackTarget(Protocol):
    """Where a call's write-back channels are appended: typically the agent's own call
    context, whose lists the agent loop already reads (see :class:`CollectedWriteBack`)."""

    sent_files: list[SentFile]
    injected_tools: list[InjectedTool]
    sent_rich_messages: list[RichMessage]


@dataclass
class CollectedWriteBack:
    """A ready-made :class:`WriteBackTarget`: the write-backs of every call given it."""

    sent_files: list[SentFile] = field(default_factory=list)
    injected_tools: list[InjectedTool] = field(default_factory=list)
    sent_rich_messages: list[RichMessage] = field(default_factory=list)


@dataclass
class _Attempt:
    """What one remote attempt delivered before it ended."""

    events: int = 0
    unconnected: bool = False
    chunks: StreamedFiles = field(default_factory=StreamedFiles)


class RemoteToolRegistry:
    """Runs an agent's tools in process or on a stargrpc server, behind one ``call()``.

    Example::

        local = load_registry(["./tools"], bundled=False)   # the runtime's own tool modules
        async with RemoteToolRegistry.connect("tools.internal:50051", api_key=key,
                                              local=local,
                                              tools_force_in_process={"remember"}) as tools:
            result = await tools.call("echo", {"text": "hi"}, into=agent_ctx)

    Args:
        mode: ``"remote"`` (the default when a channel is given) or ``"in_process"``.
        channel: A grpc.aio channel to the server (needed in remote mode; left open unless
            ``own_channel``).
        local: The tools the runtime holds itself; pinned tools and fallbacks run here.
        tools_force_in_process: Tools that always run locally, even in remote mode; each
            must be in ``local``.
        local_fallback: Run a tool locally when the server cannot be reached (see the
            module docstring for exactly when).
        api_key: An API key for the server (or ``token``: a JWT).
        token: A JWT for the server.
        metadata: Extra metadata on every remote call.
        retry: The remote retry policy; its attempts are used up before a fallback.
        settings: Settings of the local runtime (critic timeouts, permissions, limits,
            audit redaction); default ``Settings()``.
        policy: Who may run which tool locally; default the policy ``settings`` configure.
        principal: Who local runs execute as; default :data:`LOCAL_PRINCIPAL`.
        audit_store: An opened audit store for the records of local runs; without one
            they are only logged.
        connect_timeout: Seconds a remote call waits for a channel that is not connected
            to connect; past them the server counts as unreachable (a fallback). None: the
            call's own timeout alone bounds the wait.
        own_channel: Close the channel in :meth:`close`.

    Raises:
        ValueError: Remote mode without a channel, or a pinned tool not held locally.
    """

    mode: Mode
    local: Registry
    tools_force_in_process: frozenset[str]
    local_fallback: bool
    principal: Principal
    runtime: Runtime
    _channel: grpc.aio.Channel | None
    _client: AsyncClient | None
    _audit_store: AuditStore | None
    _audit_limits: AuditLimits
    connect_timeout: float | None
    _own_channel: bool

    def __init__(self, *, mode: Mode | None = None, channel: grpc.aio.Channel | None = None,
                 local: Registry | None = None,
                 tools_force_in_process: Collection[str] = (), local_fallback: bool = True,
                 api_key: str | None = None, token: str | None = None,
                 metadata: Metadata = (), retry: RetryPolicy | None = None,
                 settings: Settings | None = None, policy: ToolPolicy | None = None,
                 principal: Principal = LOCAL_PRINCIPAL,
                 audit_store: AuditStore | None = None, connect_timeout: float | None = None,
                 own_channel: bool = False) -> None:
        self.mode = mode if mode is not None else ("remote" if channel is not None
                                                   else "in_process")
        if self.mode not in ("in_process", "remote"):
            raise ValueError(f"mode must be 'in_process' or 'remote', not {self.mode!r}")
        if self.mode == "remote" and channel is None:
            raise ValueError("remote mode needs a channel to the server")
        self.local = local if local is not None else Registry()
        self.tools_force_in_process = frozenset(tools_force_in_process)
        missing = sorted(self.tools_force_in_process - set(self.local))
        if missing:
            raise ValueError(f"tools_force_in_process names tools the local registry does "
                             f"not hold: {', '.join(missing)}")
        self.local_fallback = local_fallback
        self.principal = principal
        settings = settings if settings is not None else Settings()
        # The server's own runtime, with its in-memory run store: the same validation,
        # permission check, supervision and event log as a call the server serves.
        self.runtime = Runtime(self.local, settings=settings,
                               policy=policy if policy is not None
                               else RolePolicy.from_settings(settings))
        self._channel = channel
        self._client = (AsyncClient(channel, api_key=api_key, token=token, metadata=metadata,
                                    retry=retry) if channel is not None else None)
        self._audit_store = audit_store
        self._audit_limits = AuditLimits.from_settings(settings)
        self.connect_timeout = connect_timeout
        self._own_channel = own_channel

    @classmethod
    def connect(cls, target: str, *, tls: bool = False, ca_file: str | Path | None = None,
                cert_file: str | Path | None = None, key_file: str | Path | None = None,
                options: Sequence[tuple[str, Any]] = (), **kwargs: Any) -> RemoteToolRegistry:
        """A remote-mode registry on a channel of its own to ``target`` (``host:port``),
        closed by :meth:`close`; TLS as for :meth:`AsyncClient.connect`, and the other
        arguments of the constructor."""
        channel = open_channel(target, tls=tls, ca_file=ca_file, cert_file=cert_file,
                               key_file=key_file, options=options)
        return cls(mode=kwargs.pop("mode", "remote"), channel=channel, own_channel=True,
                   **kwargs)

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Loads the catalog in remote mode. A server that cannot be reached is logged, not
        raised: calls still work, and the catalog is loaded after the first remote call
        that reaches the server."""
        if self.mode == "remote":
            with contextlib.suppress(CallError):
                await self.reload_catalog()

    async def close(self) -> None:
        """Stops local runs still going, and closes the channel if the registry opened it."""
        for run in list(self.runtime.runs.values()):
            run.stop(Outcome.CANCELLED, "CANCELLED", "the tool registry was closed")
        if self._own_channel and self._channel is not None:
            await self._channel.close()

    async def __aenter__(self) -> RemoteToolRegistry:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    # -- the catalog -----------------------------------------------------------------------

    @property
    def catalog(self) -> Catalog | None:
        """The server's catalog as last loaded (remote mode), else None."""
        return self._client.catalog if self._client is not None else None

    async def reload_catalog(self) -> Catalog:
        """Loads the server's catalog (ListTools; the hash is sent with every call).

        Raises:
            CallError: The server refused the call or could not be reached (logged too).
            ValueError: The registry has no channel.
        """
        if self._client is None:
            raise ValueError("an in-process registry has no server catalog")
        try:
            catalog = await self._client.list_tools()
        except CallError as error:
            _log.warning("catalog_not_loaded", code=error.code.name, error=error.message)
            raise
        _log.info("catalog_loaded", catalog_hash=catalog.catalog_hash, tools=len(catalog.tools))
        return catalog

    def tool_names(self) -> frozenset[str]:
        """The tools a call may name: the catalog's (when loaded) and the local ones."""
        names = set(self.local)
        if self.mode == "remote" and self.catalog is not None:
            names.update(self.catalog.names)
        return frozenset(names)

    def is_allowed(self, tool: str) -> bool:
        """False when the loaded catalog marks ``tool`` not callable for this caller."""
        catalog = self.catalog
        return catalog is None or tool not in catalog or catalog[tool].callable

    # -- calls -----------------------------------------------------------------------------

    def runs_locally(self, tool: str) -> bool:
        """Whether a call of ``tool`` goes to the local registry (before any fallback)."""
        return self.mode == "in_process" or tool in self.tools_force_in_process

    async def call(self, tool: str, arguments: Mapping[str, Any] | str | None = None, *,
                   on_event: Callable[[Event], object] | None = None,
                   into: WriteBackTarget | None = None,
                   context: InvocationContext | None = None,
                   timeout: float | None = None,  # noqa: ASYNC109 (a gRPC deadline)
                   idempotency_key: str | None = None) -> Result:
        """Runs ``tool`` where the registry routes it and returns its Result.

        Args:
            tool: The tool's name.
            arguments: A JSON-ready mapping, or raw JSON text.
            on_event: Called with every event, the Result last, in ``seq`` order.
            into: Where the Result's write-backs are appended (sent files complete, even
                those that travelled as chunks).
            context: The invocation context (end user, channel, trace id, labels).
            timeout: Seconds for the whole call; locally, the critic stops the run with
                ``Result{TIMEOUT}`` (code ``CLIENT_DEADLINE``) when it passes.
            idempotency_key: Repeating a key attaches to the first run (per server, or per
                registry for local runs) instead of running the tool again.

        Returns:
            The Result; a run that ends badly is a Result with that outcome.

        Raises:
            CallError: The call was refused before a run started (unknown tool, bad
                arguments, permission — from the catalog, the server or the local policy),
                or the server could not be reached and there was no fallback.
            ResumeError: The remote run started but its stream could not be resumed; the
                tool is not run again.
        """
        if not self.is_allowed(tool):
            catalog = self.catalog
            assert catalog is not None
            raise CallError(grpc.StatusCode.PERMISSION_DENIED,
                            f"the catalog marks tool {tool!r} not callable for this caller",
                            reason="TOOL_NOT_ALLOWED",
                            metadata={"tool_name": tool, "catalog_hash": catalog.catalog_hash})
        if self.runs_locally(tool):
            return await self._run_local(tool, arguments, method=IN_PROCESS_METHOD,
                                         on_event=on_event, into=into, context=context,
                                         timeout=timeout, idempotency_key=idempotency_key)
        attempt = _Attempt()
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            await self._connect(deadline, attempt)
            result = await self._run_remote(tool, arguments, attempt, on_event=on_event,
                                            context=context, timeout=_left(deadline),
                                            idempotency_key=idempotency_key)
        except CallError as error:
            left = _left(deadline)
            if (left is not None and left <= 0) or not self._may_fall_back(tool, error, attempt):
                raise
            _log.warning("tool_fallback", tool=tool, code=error.code.name, reason=error.reason,
                        error=error.message)
            return await self._run_local(tool, arguments, method=FALLBACK_METHOD,
                                         on_event=on_event, into=into, context=context,
                                         timeout=left, idempotency_key=idempotency_key,
                                         detail=f"remote {error.code.name}: {error.message}")
        if self.catalog is None:  # the server answered: it can give the catalog now
            with contextlib.suppress(CallError):
                await self.reload_catalog()
        return _deliver(result, attempt.chunks, into)

    async def _connect(self, deadline: float | None, attempt: _Attempt) -> None:
        """Waits (up to :attr:`connect_timeout`) for a channel that is still connecting.

        Raises:
            CallError: DEADLINE_EXCEEDED: it did not connect in time.
        """
        assert self._channel is not None
        state = self._channel.get_state(try_to_connect=True)
        connecting = (grpc.ChannelConnectivity.IDLE, grpc.ChannelConnectivity.CONNECTING)
        if self.connect_timeout is None or state not in connecting:
            return
        left = _left(deadline)
        wait = self.connect_timeout if left is None else min(self.connect_timeout, left)
        try:
            async with asyncio.timeout(wait):
                # A refused connection turns TRANSIENT_FAILURE at once: the call then fails
                # UNAVAILABLE by itself; only a connection that hangs is waited for here.
                while state in connecting:
                    await self._channel.wait_for_state_change(state)
                    state = self._channel.get_state(try_to_connect=True)
        except TimeoutError:
            attempt.unconnected = True
            raise CallError(grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"the server did not accept a connection within {wait:g} s",
                            ) from None

    def _may_fall_back(self, tool: str, error: CallError, attempt: _Attempt) -> bool:
        """Whether ``error`` proves the tool did not run remotely, and it can run here.

        Raises:
            CallError: The failure allows a fallback but the tool is not held locally.
        """
        if not self.local_fallback or attempt.events:
            return False
        # A deadline counts only when the channel never connected: a connected server may be
        # running the tool without having said so yet.
        if error.code is not grpc.StatusCode.UNAVAILABLE and not attempt.unconnected:
            return False
        if tool not in self.local:
            raise CallError(error.code, f"{error.message} (the service cannot be reached and "
                            f"tool {tool!r} is not held locally, so there is no fallback)",
                            reason=error.reason, metadata=error.metadata,
                            retry_delay=error.retry_delay) from error
        return True

    async def _run_remote(self, tool: str, arguments: Mapping[str, Any] | str | None,
                          attempt: _Attempt, *, on_event: Callable[[Event], object] | None,
                          context: InvocationContext | None,
                          timeout: float | None,  # noqa: ASYNC109 (a gRPC deadline)
                          idempotency_key: str | None) -> Result:
        assert self._client is not None
        async for event in self._client.execute(tool, arguments, context=context,
                                                timeout=timeout,
                                                idempotency_key=idempotency_key):
            attempt.events += 1
            _keep_chunk(event, attempt.chunks)
            if on_event is not None:
                on_event(event)
            if isinstance(event, Result):
                return event
        raise AssertionError("execute() always ends with a Result")  # pragma: no cover

    async def _run_local(self, tool: str, arguments: Mapping[str, Any] | str | None, *,
                         method: str, on_event: Callable[[Event], object] | None,
                         into: WriteBackTarget | None, context: InvocationContext | None,
                         timeout: float | None,  # noqa: ASYNC109 (a gRPC deadline)
                         idempotency_key: str | None,
                         detail: str = "") -> Result:
        started, at = time.monotonic(), utc_now()
        invocation = _invocation_dict(context)
        audit = _LocalAudit(method=method, at=at, started=started, tool=tool,
                            idempotency_key=idempotency_key or "", invocation=invocation,
                            detail=detail)
        try:
            text = arguments if isinstance(arguments, str) else json.dumps(dict(arguments or {}))
            # Supervised as on a server: the configured critic, the caller's deadline.
            policy = SupervisionPolicy.for_call(self.runtime.settings, timeout)
            call = RunRequest(tool_name=tool, arguments=decode_json(text, self.runtime.limits),
                               idempotency_key=idempotency_key or "", invocation=invocation,
                               policy=policy)
            audit.arguments = call.arguments
            admitted = await self.runtime.admit(call, self.principal)
        except RequestError as error:
            audit.outcome = outcome_for_status(error.code)
            audit.detail = "; ".join(filter(None, (detail, f"{error.reason}: {error.message}")))
            await self._audit(audit)
            raise _call_error(error) from None
        run = admitted.run
        chunks = StreamedFiles()
        result: Result | None = None
        cuts: list[str] = []  # what the caller got less of than the tool gave, as on a server
        try:
            async for raw in admitted.log.follow(0):
                cut = cut_notice(raw)
                if cut is not None:
                    cuts.append(cut)
                event = event_from_proto(raw)
                _keep_chunk(event, chunks)
                if on_event is not None:
                    on_event(event)
                if isinstance(event, Result):
                    result = event
                    break
        finally:
            if result is None and run is not None:  # the caller went away: so does the run
                run.stop(Outcome.CANCELLED, "CLIENT_CANCELLED", "the caller cancelled the call")
        assert result is not None, "a run's log always ends with its Result"
        audit.finish(result, run, cuts,
                     principal=run.principal if run is not None else self.principal)
        await self._audit(audit)
        return _deliver(result, chunks, into)

    async def _audit(self, audit: _LocalAudit) -> None:
        record = audit.record(self.principal, self.runtime.registry, self._audit_limits)
        # As the server's audit log: arguments and results only in the store, except for
        # privileged tools.
        hidden = {"seq", "prev_hash", "hash"} | (set() if record.privileged
                                                 else {"arguments", "result"})
        fields = {name: value for name, value in record.as_dict().items()
                  if name not in hidden and value not in ("", None)}
        if record.outcome == "ok" and record.method == IN_PROCESS_METHOD:
            _log.info("local_audit", **fields)
        else:
            _log.warning("local_audit", **fields)
        if self._audit_store is None:
            return
        try:
            await self._audit_store.append([record])
        except Exception as exc:  # the run already happened: keep serving, say so
            _log.error("local_audit_not_stored", error=str(exc), audit_id=record.id)


@dataclass
class _LocalAudit:
    """What is known about one local call, for its audit record."""

    method: str
    at: str
    started: float
    tool: str
    idempotency_key: str
    invocation: dict[str, Any]
    detail: str = ""
    arguments: dict[str, Any] | None = None
    outcome: str = ""
    run_id: str = ""
    result: events_pb2.Result | None = None
    result_view: str | None = None
    acting_for: str = ""

    def finish(self, result: Result, run: Run | None, cuts: Sequence[str], *,
               principal: Principal) -> None:
        """Takes the outcome from the run's Result (and the tool's audit view, if any), and
        the cuts its notices announced."""
        self.outcome = outcome_for_result(result.raw.result)
        self.run_id = result.run_id
        self.acting_for = principal.acting_for
        error = f"{result.error_code}: {result.error_message}" if result.error_code else ""
        self.detail = "; ".join(filter(None, (self.detail, error, *cuts)))
        self.result = result.raw.result
        self.result_view = run.audit_result if run is not None else None
        if run is not None and run.audit_arguments is not None:
            self.arguments = run.audit_arguments

    def record(self, principal: Principal, registry: Registry, limits: AuditLimits
               ) -> AuditRecord:
        """The audit record, redacted and cut by the server's own audit limits."""
        spec = registry.get(self.tool)
        return AuditRecord(
            id=new_id(), time=self.at, method=self.method, peer="local",
            principal=principal.id, acting_for=self.acting_for, auth_method=principal.method,
            tool=cut(self.tool, 200), run_id=self.run_id,
            arguments=limits.arguments_text(self.arguments),
            result=limits.result_text(self.result, self.result_view),
            invocation=limits.invocation_text(self.invocation),
            outcome=self.outcome or "error", detail=limits.detail_text(self.detail),
            duration_ms=round((time.monotonic() - self.started) * 1000, 3),
            usage=limits.usage_text(self.result),
            idempotency_key=self.idempotency_key,
            privileged=spec.privileged if spec is not None else False)


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()


def _invocation_dict(context: InvocationContext | None) -> dict[str, Any]:
    if context is None:
        return {}
    if isinstance(context, Mapping):
        return dict(context)
    from google.protobuf import json_format

    return json_format.MessageToDict(context, preserving_proto_field_name=True)


def _call_error(error: RequestError) -> CallError:
    """The CallError a server would have sent for ``error``, so callers handle one type."""
    violations = [Violation(v.field, v.description)
                  for v in (error.violations if isinstance(error, InvalidArgument) else ())]
    delay = (error.retry_after if isinstance(error, ResourceExhausted | Unavailable)
             else None)
    return CallError(error.code, error.message, reason=error.reason, metadata=error.metadata,
                     violations=violations, retry_delay=delay)


def _keep_chunk(event: Event, chunks: StreamedFiles) -> None:
    if isinstance(event, FileChunk):
        chunks.add(event.file_id, event.offset, event.data)


def _assembled(sent: SentFile, chunks: StreamedFiles) -> SentFile:
    """``sent`` with the content of its chunks, when they make up the whole file."""
    data = chunks.content(sent.file_id, sent.size, sent.sha256) if sent.streamed else None
    return sent if data is None else dataclasses.replace(sent, content=data)


def _deliver(result: Result, chunks: StreamedFiles, into: WriteBackTarget | None) -> Result:
    """The Result with streamed files put back together, its write-backs appended to
    ``into``; the same for remote and local runs."""
    if chunks:
        result = dataclasses.replace(result, files=[_assembled(sent, chunks)
                                                    for sent in result.files])
    if into is not None:
        into.sent_files.extend(result.files)
        into.injected_tools.extend(result.injected_tools)
        into.sent_rich_messages.extend(result.rich_messages)
    return result
