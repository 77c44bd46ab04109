"""What a tool sees while it runs: :class:`ToolContext` and its steps.

A tool reports progress through its context — ``ctx.step()``, ``step.delta()``,
``ctx.heartbeat()`` — and hands things back through the write-back channels —
``ctx.send_file()``, ``ctx.inject_tool()``, ``ctx.send_rich_message()``. Every call becomes
an event in the run's log, which is what the Execute and WatchRun streams carry.
"""

from __future__ import annotations

import asyncio
import hashlib
import mimetypes
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

import structlog
from pydantic import BaseModel

from stargrpc.principal import Principal
from stargrpc.runs.state import RunState, SyncRunState, scope_key
from stargrpc.runs.trees import ChildResult
from stargrpc.runs.usage import RunUsage
from stargrpc.settings import Settings
from stargrpc.stores.base import StateStore
from stargrpc.stores.memory import MemoryStateStore
from stargrpc.text import as_name

if TYPE_CHECKING:
    from stargrpc.registry import ToolSpec
    from stargrpc.runs.session_handle import RunSession


@dataclass(frozen=True)
class SentFileRecord:
    """A file handed back by a tool."""

    file_id: str
    name: str
    mime_type: str
    data: bytes
    sha256: str

    @property
    def size(self) -> int:
        """Size in bytes."""
        return len(self.data)


@dataclass(frozen=True)
class InjectedToolRecord:
    """A tool the run asks the agent to add to its palette."""

    name: str
    description: str
    input_schema: Mapping[str, Any]


@dataclass(frozen=True)
class RichMessageRecord:
    """A rich message (card, chart, …) the tool posted."""

    kind: str
    payload: Mapping[str, Any]


@dataclass
class WriteBack:
    """The write-back channels a run accumulates; they travel in ``Result.writeback``."""

    sent_files: list[SentFileRecord] = field(default_factory=list)
    injected_tools: list[InjectedToolRecord] = field(default_factory=list)
    rich_messages: list[RichMessageRecord] = field(default_factory=list)


class RunHandle(Protocol):
    """What a context and its steps need of their run (:class:`stargrpc.runs.run.Run`).

    A protocol rather than the class, so that the run builds on the context and not the
    other way round.
    """

    run_id: str
    root_run_id: str
    state_store: StateStore | None
    state_scopes: set[str] | None
    spec: ToolSpec
    principal: Principal
    invocation: Mapping[str, Any]
    writeback: WriteBack
    root_step: ToolStep
    audit_arguments: dict[str, Any] | None
    audit_result: str | None

    @property
    def stop_requested(self) -> bool:
        """Whether someone asked the run to stop."""
        ...

    @property
    def usage(self) -> RunUsage:
        """What the run used, as its tool reports it."""
        ...

    def next_step_id(self) -> str:
        """A step id unique within the run."""
        ...

    async def start_step(self, step: ToolStep) -> None:
        """Emits the START of ``step``."""
        ...

    async def end_step(self, step: ToolStep, *, error: bool) -> None:
        """Emits the END of ``step``."""
        ...

    async def emit_delta(self, step: ToolStep, text: str, channel: str) -> None:
        """Emits partial output of ``step``."""
        ...

    async def emit_heartbeat(self, message: str, progress: float | None) -> None:
        """Emits a heartbeat."""
        ...

    async def emit_notice(self, code: str, message: str, *, warning: bool = True) -> None:
        """Emits a notice from the server."""
        ...

    async def next_steering(self) -> str:
        """Waits for the next steering message."""
        ...

    def steering_pending(self) -> list[str]:
        """The steering messages not read yet, taken off the queue."""
        ...

    async def call(self, tool: str, arguments: Mapping[str, Any], *, priority: int = 0,
                   timeout: float | None = None, calling_step_id: str = "") -> ChildResult:  # noqa: ASYNC109
        """Runs ``tool`` as a child run."""
        ...


#: The state store of runs made without a runtime's (a bare :class:`~stargrpc.runs.run.Run`).
_fallback_state = MemoryStateStore()


def _run_state(run: RunHandle, settings: Settings, scope: str) -> RunState:
    name = scope_key(scope, run_id=run.run_id, root_run_id=run.root_run_id,
                     principal=run.principal)
    if scope in ("run", "tree"):
        # Remembered so that the run's end starts the scope's retention.
        if run.state_scopes is None:
            run.state_scopes = set()
        run.state_scopes.add(name)
    writable = scope != "global" or run.spec.name in settings.state_global_writers
    store = run.state_store if run.state_store is not None else _fallback_state
    return RunState(store, scope, name, settings, writable=writable)


# The innermost open step of the running task, so nested steps find their parent.
_current_step: ContextVar[ToolStep | None] = ContextVar("stargrpc_current_step", default=None)


def forget_callers_step() -> None:
    """Clears the open step a run's task inherited from the run that called it (a child
    run's task starts in a copy of its parent's context): its steps are its own."""
    _current_step.set(None)


class ToolStep:
    """An open step of a run. Use it as ``async with ctx.step("Title") as step:``.

    Leaving the block normally ends the step COMPLETE; leaving it with an exception ends it
    ERROR. The run ends any step still open when the tool stops.
    """

    id: str
    parent_id: str
    kind: str
    title: str
    summary: str
    detail: dict[str, Any] | None
    _run: RunHandle
    _token: Any
    #: Whether the step's START has been emitted (a step is entered once).
    started = False

    def __init__(self, run: RunHandle, step_id: str, parent_id: str, title: str, kind: str,
                 detail: Mapping[str, Any] | None = None) -> None:
        # Weak: the run holds its top-level step, and the tool's context variables its
        # open steps; a strong reference back would make each a cycle.
        self._run = weakref.proxy(run)
        self.id = step_id
        self.parent_id = parent_id
        self.title = title
        self.kind = kind
        self.summary = ""
        self.detail = dict(detail) if detail else None
        self._token = None

    async def delta(self, text: str, *, channel: str = "") -> None:
        """Streams partial output of this step. Empty text is not sent.

        Args:
            text: The new output.
            channel: Which output it belongs to, e.g. "stdout" or "stderr".
        """
        if text:
            await self._run.emit_delta(self, text, channel)

    async def __aenter__(self) -> ToolStep:
        await self._run.start_step(self)
        self._token = _current_step.set(self)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._token is not None:
            # Taken once: a second exit of the step (ended already) must not fail the tool.
            token, self._token = self._token, None
            _current_step.reset(token)
        if exc_type is None:
            await self._run.end_step(self, error=False)
        elif not issubclass(exc_type, asyncio.CancelledError):
            await self._run.end_step(self, error=True)
        # On cancellation the run closes the step itself once the tool task is gone.


class ToolContext:
    """The handle a tool gets for one run.

    Attributes:
        run_id: The run's id, as every event carries it.
        tool_name: The tool being run.
        principal: The authenticated caller (never taken from the request body).
        invocation: The invocation context of the request (end user, channel, labels …).
        logger: A structlog logger bound with the run id and tool name.
        settings: The server's settings, for tools that are configured there.
    """

    run_id: str
    tool_name: str
    principal: Principal
    invocation: Mapping[str, Any]
    settings: Settings
    _run: RunHandle
    _logger: Any

    def __init__(self, run: RunHandle, settings: Settings) -> None:
        """
        Args:
            run: The run the tool runs in.
            settings: The server's settings, handed by the runtime that started the run.
        """
        self._run = run
        self.run_id = run.run_id
        self.tool_name = run.spec.name
        self.principal = run.principal
        self.invocation = run.invocation
        self.settings = settings
        self._logger = None

    @property
    def session(self) -> RunSession | None:
        """The session the run was called in (``ExecuteRequest.session_id``): its
        ``session_id``, ``kind`` and ``folder`` (the session's folder on the server's host,
        where its files persist between calls); None for a run outside a session."""
        session: RunSession | None = getattr(self._run, "session", None)
        return session

    @property
    def logger(self) -> Any:
        """A structlog logger bound with the run id and tool name."""
        # Bound on first use: most tools never log, and binding costs more than the rest of
        # the context together.
        if self._logger is None:
            self._logger = structlog.get_logger("stargrpc.tool").bind(
                run_id=self.run_id, tool=self.tool_name)
        return self._logger

    def step(self, title: str, *, kind: str | None = None, parent: ToolStep | None = None,
             detail: Mapping[str, Any] | None = None) -> ToolStep:
        """A new step, nested under ``parent`` or the innermost open step.

        Args:
            title: What the step does, for people.
            kind: Step kind; defaults to the tool's kind.
            parent: Explicit parent step; defaults to the innermost open one, else the
                run's top-level step.
            detail: Structured details shown with the step.
        """
        parent_step = parent or _current_step.get() or self._run.root_step
        return ToolStep(self._run, self._run.next_step_id(), parent_step.id, title,
                    kind if kind is not None else (self._run.spec.kind or "tool"), detail)

    async def delta(self, text: str, *, channel: str = "") -> None:
        """Streams partial output on the innermost open step (or the top-level step)."""
        if text:
            step = _current_step.get() or self._run.root_step
            await self._run.emit_delta(step, text, channel)

    async def heartbeat(self, message: str = "", *, progress: float | None = None) -> None:
        """Says the tool is alive. A changed message or a rising progress value counts as
        progress for the supervisor; a bare repeated heartbeat does not."""
        await self._run.emit_heartbeat(message, progress)

    async def notice(self, code: str, message: str, *, warning: bool = False) -> None:
        """Tells the caller something about the run that is neither output nor progress
        (a Notice), such as what was left out of it.

        Args:
            code: A short UPPER_SNAKE reason code.
            message: What happened, for people.
            warning: A warning rather than information.
        """
        await self._run.emit_notice(code, message, warning=warning)

    def send_file(self, name: str, data: bytes, mime_type: str | None = None) -> SentFileRecord:
        """Hands a file back to the caller (``Result.writeback.sent_files``).

        Args:
            name: File name shown to the caller.
            data: The content.
            mime_type: Defaults to a guess from the name.
        """
        name = as_name(name)
        record = SentFileRecord(
            file_id=f"{self.run_id}-f{len(self._run.writeback.sent_files) + 1}",
            name=name,
            mime_type=mime_type or mimetypes.guess_type(name)[0] or "application/octet-stream",
            data=bytes(data),
            sha256=hashlib.sha256(data).hexdigest(),
        )
        self._run.writeback.sent_files.append(record)
        return record

    def inject_tool(self, name: str, description: str, schema: Mapping[str, Any]) -> None:
        """Asks the agent to add a tool to its palette (``writeback.injected_tools``)."""
        self._run.writeback.injected_tools.append(
            InjectedToolRecord(name, description, dict(schema)))

    def send_rich_message(self, kind: str, payload: Mapping[str, Any]) -> None:
        """Posts a rich message such as a card (``writeback.sent_rich_messages``)."""
        self._run.writeback.rich_messages.append(RichMessageRecord(kind, dict(payload)))

    def state(self, scope: str) -> RunState:
        """State that outlives this call, in one of four scopes: ``run`` (this run),
        ``tree`` (the root run's, shared by a whole call tree), ``principal`` (the caller's
        own, across runs) and ``global`` (every tool's; written only by the tools named in
        ``state_global_writers``)::

            seen = await ctx.state("principal").get("seen", [])
            await ctx.state("principal").set("seen", [*seen, url], ttl=3600)

        See :mod:`stargrpc.runs.state` for the limits and the errors.

        Raises:
            StateBadScope: No such scope.
        """
        return _run_state(self._run, self.settings, scope)

    async def call(self, tool: str, args: Mapping[str, Any] | BaseModel | None = None, *,
                   priority: int = 0, timeout: float | None = None) -> ChildResult:  # noqa: ASYNC109
        """Runs another tool as a **child run** of this one, and returns its Result::

            found = await ctx.call("knowledge_search", {"query": "retention"})
            print(found.output, found.structured_output)

        The child goes through the same pipeline as any call: this run's principal and its
        permissions, argument validation, concurrency limits, supervision and an audit
        record of its own. While it runs, its steps and deltas appear in this run's stream
        nested under the innermost open step (marked with the child's run id). Cancelling
        this run cancels the child. See :mod:`stargrpc.runs.trees`.

        Args:
            tool: The tool to run.
            args: Its arguments (a mapping or a model); None for none.
            priority: The child's priority, passed on with it (its lane's, when lanes run).
            timeout: Seconds the child may take (its supervision deadline); the tree's
                ``max_tree_seconds`` bounds it too.

        Returns:
            The child's Result (``.outcome``, ``.output``, ``.structured_output``,
            ``.files``), when it ended OK.

        Raises:
            ChildRunRefused: The child was refused before it started (``.status``,
                ``.reason``: RUN_DEPTH_EXCEEDED, RUN_TREE_FULL, RUN_TREE_EXPIRED,
                TOOL_NOT_FOUND, PERMISSION_DENIED, invalid arguments …).
            ChildRunError: The child ended other than OK (``.outcome``, ``.code``,
                ``.child``). Left uncaught, it ends this run with the child's outcome.
        """
        step = _current_step.get() or self._run.root_step
        return await self._run.call(tool, _arguments_of(args), priority=priority,
                                    timeout=timeout, calling_step_id=step.id)

    def audit_view(self, *, arguments: Mapping[str, Any] | None = None,
                   result: str | None = None) -> None:
        """Replaces what the audit record shows for this run's arguments and/or result, for a
        tool whose real arguments or output hold a secret the audit must not keep."""
        if arguments is not None:
            self._run.audit_arguments = dict(arguments)
        if result is not None:
            self._run.audit_result = result

    @property
    def usage(self) -> RunUsage:
        """The run's receipt, for what the server cannot measure itself (``Result.usage``).

        A tool whose network traffic goes through it counts that traffic
        (``ctx.usage.add_network(sent=…, received=…)``); a tool that runs a process tree
        of its own reports what it measured of it (``ctx.usage.add_processes(…)``; the
        sandbox does this for every command). What nobody reports stays unset in the
        Result: "not measured".
        """
        return self._run.usage

    @property
    def cancelled(self) -> bool:
        """Whether the run has been asked to stop."""
        return self._run.stop_requested

    async def steering(self) -> AsyncIterator[str]:
        """The steering messages sent to this run (SteerRun, the critic), in order, each
        as it arrives; the iteration waits for the next one until the run ends. Read it
        in a task of its own, or break out when a message has been handled::

            async for message in ctx.steering():
                ...
        """
        while True:
            yield await self._run.next_steering()

    def steering_pending(self) -> list[str]:
        """The steering messages that arrived and were not read yet, without waiting (an
        empty list when there are none); each is returned once."""
        return self._run.steering_pending()


class SyncToolStep:
    """An open step of a plain ``def`` tool: ``with ctx.step("Title") as step:``, ending
    COMPLETE when the block ends normally and ERROR when it raises."""

    _ctx: SyncToolContext
    _step: ToolStep

    def __init__(self, ctx: SyncToolContext, step: ToolStep) -> None:
        self._ctx = ctx
        self._step = step

    @property
    def id(self) -> str:
        """The step's id."""
        return self._step.id

    @property
    def title(self) -> str:
        """The step's title."""
        return self._step.title

    @property
    def summary(self) -> str:
        """A one-line summary, sent when the step ends."""
        return self._step.summary

    @summary.setter
    def summary(self, value: str) -> None:
        self._step.summary = value

    def delta(self, text: str, *, channel: str = "") -> None:
        """Streams partial output of this step (see :meth:`ToolStep.delta`)."""
        self._ctx._call(lambda: self._step.delta(text, channel=channel))

    def __enter__(self) -> SyncToolStep:
        # The run's events, not ToolStep.__aenter__: the open-step context variable of the
        # loop would not follow this thread, so the sync context keeps its own stack.
        self._ctx._call(lambda: self._step._run.start_step(self._step))
        self._ctx._open.append(self)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._ctx._open and self._ctx._open[-1] is self:
            self._ctx._open.pop()
        self._ctx._call(lambda: self._step._run.end_step(self._step,
                                                         error=exc_type is not None))


class SyncToolContext:
    """The context of a plain ``def`` tool, which runs in a worker thread: the same methods
    as :class:`ToolContext` (``step()`` is a plain ``with`` block), blocking until the
    event loop has recorded each event."""

    _ctx: ToolContext
    _loop: asyncio.AbstractEventLoop
    _open: list[SyncToolStep]

    def __init__(self, ctx: ToolContext, loop: asyncio.AbstractEventLoop) -> None:
        self._ctx = ctx
        self._loop = loop
        self._open = []
        self.run_id = ctx.run_id
        self.tool_name = ctx.tool_name
        self.principal = ctx.principal
        self.invocation = ctx.invocation
        self.settings = ctx.settings

    @property
    def logger(self) -> Any:
        """A structlog logger bound with the run id and tool name."""
        return self._ctx.logger

    def _call(self, make: Callable[[], Awaitable[None]]) -> None:
        async def run() -> None:
            await make()

        asyncio.run_coroutine_threadsafe(run(), self._loop).result()

    def step(self, title: str, *, kind: str | None = None, parent: SyncToolStep | None = None,
             detail: Mapping[str, Any] | None = None) -> SyncToolStep:
        """A new step, nested under ``parent`` or the innermost open step; use it as
        ``with ctx.step("Title") as step:`` (see :meth:`ToolContext.step`)."""
        if parent is None and self._open:
            parent = self._open[-1]
        step = self._ctx.step(title, kind=kind, detail=detail,
                              parent=parent._step if parent is not None
                              else self._ctx._run.root_step)
        return SyncToolStep(self, step)

    def delta(self, text: str, *, channel: str = "") -> None:
        """Streams partial output on the innermost open step (or the top-level step)."""
        if not text:
            return
        step = self._open[-1]._step if self._open else self._ctx._run.root_step
        self._call(lambda: step.delta(text, channel=channel))

    def heartbeat(self, message: str = "", *, progress: float | None = None) -> None:
        """Says the tool is alive."""
        self._call(lambda: self._ctx.heartbeat(message, progress=progress))

    def notice(self, code: str, message: str, *, warning: bool = False) -> None:
        """See :meth:`ToolContext.notice`."""
        self._call(lambda: self._ctx.notice(code, message, warning=warning))

    def send_file(self, name: str, data: bytes, mime_type: str | None = None) -> SentFileRecord:
        """See :meth:`ToolContext.send_file`."""
        return self._ctx.send_file(name, data, mime_type)

    def inject_tool(self, name: str, description: str, schema: Mapping[str, Any]) -> None:
        """See :meth:`ToolContext.inject_tool`."""
        self._ctx.inject_tool(name, description, schema)

    def send_rich_message(self, kind: str, payload: Mapping[str, Any]) -> None:
        """See :meth:`ToolContext.send_rich_message`."""
        self._ctx.send_rich_message(kind, payload)

    def state(self, scope: str) -> SyncRunState:
        """See :meth:`ToolContext.state`: the same methods, blocking
        (``ctx.state("run").set("n", 1)``)."""
        return SyncRunState(self._ctx.state(scope), self._loop)

    def call_sync(self, tool: str, args: Mapping[str, Any] | BaseModel | None = None, *,
                  priority: int = 0, timeout: float | None = None) -> ChildResult:
        """:meth:`ToolContext.call` for a plain ``def`` tool: blocks this thread until the
        child run ends; its events nest under the innermost open step."""
        step = self._open[-1]._step if self._open else self._ctx._run.root_step
        coroutine = self._ctx._run.call(tool, _arguments_of(args), priority=priority,
                                        timeout=timeout, calling_step_id=step.id)
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def audit_view(self, *, arguments: Mapping[str, Any] | None = None,
                   result: str | None = None) -> None:
        """See :meth:`ToolContext.audit_view`."""
        self._ctx.audit_view(arguments=arguments, result=result)

    @property
    def usage(self) -> RunUsage:
        """See :attr:`ToolContext.usage` (its methods may be called from this thread)."""
        return self._ctx.usage

    @property
    def cancelled(self) -> bool:
        """Whether the run has been asked to stop; a thread cannot be interrupted, so a
        long-running sync tool should check this."""
        return self._ctx.cancelled

    def steering_pending(self) -> list[str]:
        """See :meth:`ToolContext.steering_pending`."""
        future = asyncio.run_coroutine_threadsafe(_pending(self._ctx), self._loop)
        return future.result()

    def steering(self, timeout: float | None = None) -> Iterator[str]:
        """The steering messages, in order, each as it arrives (see
        :meth:`ToolContext.steering`).

        Args:
            timeout: End the iteration after this many seconds without a message (None:
                wait for as long as the run goes).
        """
        while not self._ctx.cancelled:
            future = asyncio.run_coroutine_threadsafe(_next(self._ctx, timeout), self._loop)
            message = future.result()
            if message is None:
                return
            yield message


async def _next(ctx: ToolContext, timeout: float | None) -> str | None:  # noqa: ASYNC109
    """The next steering message, or None after ``timeout`` or once the run is stopped."""
    # Timed on the loop, so a message taken just as time runs out is returned rather than
    # lost with a cancelled cross-thread future; woken each second to see a stop.
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    while not ctx.cancelled:
        wait = 1.0 if deadline is None else min(1.0, deadline - loop.time())
        if wait <= 0:
            return None
        try:
            return await asyncio.wait_for(ctx._run.next_steering(), wait)
        except TimeoutError:
            continue
    return None


async def _pending(ctx: ToolContext) -> list[str]:
    return ctx.steering_pending()


def _arguments_of(args: Mapping[str, Any] | BaseModel | None) -> dict[str, Any]:
    """A child run's arguments as the pipeline takes them: a JSON object."""
    if args is None:
        return {}
    if isinstance(args, BaseModel):
        return args.model_dump(mode="json")
    return dict(args)
