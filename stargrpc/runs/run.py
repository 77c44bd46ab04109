"""One run of one tool: its lifecycle and the events it produces.

A run emits, in order: the START of its top-level step (the tool call itself), whatever the
tool reports (its own steps nested under the top-level one, deltas, heartbeats), notices
from the supervisor, the END of any step left open, the END of the top-level step with the
final status, and exactly one Result. Every event goes through the run's log, which assigns
the gapless ``seq``. Whatever happens to the tool — a clean return, an exception, a
cancellation, a supervisor stop — the run still ends with that Result.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog
from pydantic import BaseModel

from stargrpc.errors import (
    FieldViolation,
    InvalidArgument,
    ResourceExhausted,
    ToolOutcomeError,
    reason_name,
)
from stargrpc.principal import Principal
from stargrpc.registry import ToolSpec
from stargrpc.runs.context import (
    SentFileRecord,
    SyncToolContext,
    ToolContext,
    ToolStep,
    WriteBack,
    forget_callers_step,
)
from stargrpc.runs.event_sizes import EventSizes, cut_text, size_with, split_utf8
from stargrpc.runs.outcome import Outcome, ToolResult, classify_exception, classify_return
from stargrpc.runs.result_fit import fit_result, set_duration
from stargrpc.runs.trees import (
    PARENT_RUN_CANCELLED,
    PARENT_RUN_ENDED,
    CallTree,
    ChildResult,
    ChildStarter,
)
from stargrpc.runs.usage import RunUsage, fill_usage
from stargrpc.settings import Settings
from stargrpc.stores.base import RunLog, StateStore, run_finished_error
from stargrpc.v1 import errors_pb2, events_pb2

if TYPE_CHECKING:
    from stargrpc.runs.session_handle import RunSession

log = structlog.get_logger("stargrpc.run")

#: How much of the streamed output a run keeps to return when the tool never returns
#: (timeout, cancellation); the tail is kept.
OUTPUT_TAIL_BYTES = 64 * 1024

#: How long a stopped tool gets to honour its cancellation before the run ends without it.
STOP_GRACE_SECONDS = 2.0

#: A run lets the event loop serve others after this many events of its own.
YIELD_EVERY_EVENTS = 16

#: Called with every event just before it is appended: observers may read it (progress
#: tracking) or stamp fields on it (time left before the supervisor stops the run).
EventObserver = Callable[[events_pb2.RunEvent], None]


#: A wait a run passes in its own task before its START (a person's approval, a lane's
#: turn): it returns once the run may go on, or raises :class:`ToolOutcomeError` to end the
#: run without its tool. It may set :attr:`Run.phase` while it waits.
RunGate = Callable[["Run"], Awaitable[None]]

#: The phases of a run before it ends, as ListRuns shows them (``RunState``).
PHASE_QUEUED = "queued"
PHASE_AWAITING_APPROVAL = "awaiting_approval"
PHASE_RUNNING = "running"


#: The code of the Notice each steering message leaves in the run's log.
STEERED = reason_name(errors_pb2.STEERED)
_STEER_QUEUE_FULL = reason_name(errors_pb2.STEER_QUEUE_FULL)


@dataclass(frozen=True)
class RunLimits:
    """The limits a run reads, taken from the server's settings once (by the runtime) and
    shared by every run.

    Attributes:
        sizes: What one event may carry (``max_event_bytes``, ``max_send_message_bytes``).
        inline_file_bytes: Largest sent file that travels inside the Result.
        file_chunk_bytes: Bytes per FileChunk of a file streamed before the Result.
        steer_max_bytes: Longest steering message, in UTF-8 bytes.
        steer_max_pending: Steering messages a run holds unread.
        limit_retry_after_seconds: The retry delay given with a full steering queue.
    """

    sizes: EventSizes
    inline_file_bytes: int
    file_chunk_bytes: int
    steer_max_bytes: int
    steer_max_pending: int
    limit_retry_after_seconds: float

    @classmethod
    def from_settings(cls, settings: Settings) -> RunLimits:
        """The limits ``settings`` configure."""
        sizes = EventSizes.for_send_limit(min(settings.max_event_bytes,
                                              settings.max_send_message_bytes))
        return cls(
            sizes=sizes,
            inline_file_bytes=settings.inline_file_bytes,
            # A chunk is an event like any other: it must fit what one message may carry,
            # whatever file_chunk_bytes says.
            file_chunk_bytes=min(settings.file_chunk_bytes, sizes.result_bytes),
            steer_max_bytes=settings.steer_max_bytes,
            steer_max_pending=settings.steer_max_pending,
            limit_retry_after_seconds=settings.limit_retry_after_seconds)

    @staticmethod
    @functools.cache
    def default() -> RunLimits:
        """The limits of a run made without a runtime's (in tests): those the default
        settings configure, made once."""
        return RunLimits.from_settings(_default_settings())


@functools.cache
def _default_settings() -> Settings:
    """What a tool reads as ``ctx.settings`` in a run started without a runtime's settings:
    the settings of the environment, read once."""
    return Settings()


@dataclass(frozen=True)
class StopRequest:
    """Why a run was asked to stop before the tool returned."""

    outcome: Outcome
    code: str
    message: str


class Run:
    """A tool run in progress (or finished, until its log expires).

    Attributes:
        run_id: Unique id of the run.
        root_run_id: The id of the root of the run's call tree, whose ``tree`` state the run
            shares: its own id for a top-level run.
        parent_run_id: The run that started this one (``ctx.call``, or a request's
            ``parent_run_id``); empty for a top-level run.
        depth: How far below its root the run is (0 for a top-level run).
        queued_ns: Nanoseconds the run waited before its START (``Usage.queued_seconds``).
        child_runs: Runs this run's tool started (``Usage.child_runs``).
        runtime: What starts the child runs its tool asks for (``ctx.call``); None for a
            run made without a runtime.
        state_store: Where ``ctx.state`` keeps its scopes; the runtime's, else one in memory.
        state_scopes: The run and tree scopes the run's tool asked for (``run:<id>`` …), which go
            ``state_retention_seconds`` after it ends.
        spec: The tool being run.
        args: Validated arguments.
        principal: Who started it.
        invocation: The request's invocation context as a dict.
        log: The run's event log.
        writeback: Files, injected tools and rich messages the tool handed back.
        root_step: The top-level step, the tool call itself.
        observers: Hooks called with each event before it is appended.
        finish_hooks: Hooks called once with the run after its Result is in the log.
        result: The Result, once the run has ended: the logged event's own message (read
            it, never change it: streams send the bytes made of it).
        duration_ns: The Result's duration in nanoseconds, once the run is ending.
        usage: What the run used, as its tool reports it (``ctx.usage``); the Result's
            ``usage`` is made of it and of the run's wall time.
        limits: The limits the run keeps to.
        gates: Waits the run passes, in order, before its START (see :data:`RunGate`):
            approval first, then the lane's queue. None for a run that waits for nothing.
        phase: Where the run is before it ends: :data:`PHASE_RUNNING` unless a gate set
            :data:`PHASE_AWAITING_APPROVAL` or :data:`PHASE_QUEUED` while it waits.
        parent_run_id: The run whose tool called this one (or that the caller hung it
            under); empty for a top-level run.
        depth: How many runs are above this one in its tree (0 at the root).
        queued_ns: Nanoseconds the run spent in its gates (``Usage.queued_seconds``).
        child_runs: Runs this run's tool started (``Usage.child_runs``).
        lane: The lane the run runs in, and ``priority`` its priority there (see
            :mod:`stargrpc.runs.lanes`).
    """

    run_id: str
    state_store: StateStore | None
    state_scopes: set[str] | None
    limits: RunLimits
    spec: ToolSpec
    args: BaseModel
    principal: Principal
    invocation: Mapping[str, Any]
    log: RunLog
    writeback: WriteBack
    root_step: ToolStep
    observers: list[EventObserver]
    finish_hooks: list[Callable[[Run], None]]
    result: events_pb2.Result | None
    duration_ns: int | None
    audit_arguments: dict[str, Any] | None
    audit_result: str | None
    started_monotonic: float
    _open_steps: dict[str, ToolStep]
    #: When each open step started: (seconds, nanos) since the epoch.
    _step_started: dict[str, tuple[int, int]]
    _step_counter: int
    _emitted: int
    _output_tail: list[str]
    _output_tail_size: int
    _stop: StopRequest | None
    _sizes: EventSizes
    _append_nowait: Callable[[events_pb2.RunEvent], Any]
    _tool_running: bool
    _cancel_sent: bool
    _abandoned: bool
    _abandon_timer: asyncio.TimerHandle | None
    _main_task: asyncio.Task[None] | None
    _finisher: asyncio.Task[None] | None
    _done: asyncio.Event | None
    _steering_queue: asyncio.Queue[str] | None

    # What every run starts with and most never change: the class holds it until a run
    # sets its own (a run is made for every call, and each attribute set costs).
    result = None
    duration_ns = None
    audit_arguments = None
    audit_result = None
    _result_appended: events_pb2.Result | None = None
    _usage: RunUsage | None = None
    state_store = None
    state_scopes = None
    _root_run_id: str | None = None
    gates: list[RunGate] | None = None
    phase: str = PHASE_RUNNING
    parent_run_id: str = ""
    depth: int = 0
    queued_ns: int = 0
    child_runs: int = 0
    lane: str = "default"
    priority: int = 0
    _gated = False
    #: Whether the run has passed its gates (approval, its lane's queue) and runs its tool.
    past_gates = False
    runtime: ChildStarter | None = None
    # The tree's shared count (made when the run first has a child, or handed down) and
    # the children running in this process.
    _tree: CallTree | None = None
    _children: list[Run] | None = None
    #: The session the run runs in (``ctx.session``; the sessions seam), or None.
    session: RunSession | None = None
    _step_counter = 0
    _emitted = 0
    _output_tail_size = 0
    _stop = None
    _tool_running = False
    _cancel_sent = False
    _abandoned = False
    _abandon_timer = None
    _main_task = None
    _finisher = None
    # Made when first needed: most runs are never waited on nor steered.
    _done = None
    _steering_queue = None

    def __init__(self, run_id: str, spec: ToolSpec, args: BaseModel, principal: Principal,
                 invocation: Mapping[str, Any], log: RunLog,
                 *, limits: RunLimits | None = None) -> None:
        """
        Args:
            limits: The limits to keep to; by default :meth:`RunLimits.default` (a runtime
                makes them from its settings once and hands them to each of its runs).
        """
        self.run_id = run_id
        self.limits = limits if limits is not None else RunLimits.default()
        self.spec = spec
        self.args = args
        self.principal = principal
        self.invocation = invocation
        self.log = log
        self._append_nowait = log.append_nowait
        self.writeback = WriteBack()
        self.observers = []
        self.finish_hooks = []
        self.started_monotonic = time.monotonic()
        self._open_steps = {}
        self._step_started = {}
        self._output_tail = []
        self._sizes = self.limits.sizes
        self.root_step = ToolStep(self, self.next_step_id(), "", spec.name, spec.kind or "tool")

    @property
    def root_run_id(self) -> str:
        """The root of the run's call tree: its own id unless set (the trees seam)."""
        return self._root_run_id if self._root_run_id is not None else self.run_id

    @root_run_id.setter
    def root_run_id(self, value: str) -> None:
        self._root_run_id = value

    # -- the call tree (stargrpc.runs.trees) ------------------------------------------------

    def call_tree(self) -> CallTree:
        """The tree the run belongs to, shared with the other runs of the tree in this
        process (made when first needed)."""
        if self._tree is None:
            self._tree = CallTree(self.root_run_id)
        return self._tree

    def join_tree(self, parent_run_id: str, root_run_id: str, depth: int,
                  tree: CallTree) -> None:
        """Places the run (not started) below ``parent_run_id`` in a call tree."""
        self.parent_run_id = parent_run_id
        self._root_run_id = root_run_id
        self.depth = depth
        self._tree = tree

    def adopt(self, child: Run) -> None:
        """Keeps ``child``, a run of this process below this one, until it ends: stopping
        this run stops it, and this run ending first cancels it."""
        if self._children is None:
            self._children = []
        self._children.append(child)
        child.finish_hooks.append(self._child_ended)

    def _child_ended(self, child: Run) -> None:
        if self._children is not None and child in self._children:
            self._children.remove(child)

    def relay(self, event: events_pb2.RunEvent) -> None:
        """Appends an event relayed from a child run (:class:`stargrpc.runs.trees.Relay`) to
        this run's log, through its observers: a child's progress is its parent's. Dropped
        once this run is ending."""
        if self.finished or self._stop is not None or self.log.finished:
            return
        for observer in self.observers:
            observer(event)
        self._append_nowait(event)

    async def call(self, tool: str, arguments: Mapping[str, Any], *, priority: int = 0,
                   timeout: float | None = None, calling_step_id: str = "") -> ChildResult:  # noqa: ASYNC109
        """Runs ``tool`` as a child of this run (``ctx.call``; see
        :mod:`stargrpc.runs.trees`)."""
        if self.runtime is None:
            raise RuntimeError("ctx.call needs a run started by a runtime")
        return await self.runtime.call_child(
            self, tool, arguments, priority=priority, timeout=timeout,
            calling_step_id=calling_step_id or self.root_step.id)

    @property
    def usage(self) -> RunUsage:
        """What the run used, as its tool reports it (made when first reported: most runs
        report nothing)."""
        if self._usage is None:
            self._usage = RunUsage()
        return self._usage

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, settings: Settings | None = None) -> asyncio.Task[None]:
        """Starts the run in its own task; the events appear in :attr:`log`.

        Args:
            settings: The server's settings, which the tool reads as ``ctx.settings`` (the
                run itself keeps to :attr:`limits` only); by default the environment's,
                read once per process.
        """
        if self._main_task is None:
            # A fresh context: the tool must not inherit (or leak into) the caller's
            # context variables beyond what the run sets up itself.
            self._main_task = asyncio.create_task(
                self._main(settings if settings is not None else _default_settings()),
                name=f"run-{self.run_id}", context=contextvars.copy_context())
        return self._main_task

    @property
    def finished(self) -> bool:
        """Whether the Result has been emitted."""
        return self.result is not None

    @property
    def stop_requested(self) -> bool:
        """Whether someone asked the run to stop."""
        return self._stop is not None

    def stop(self, outcome: Outcome, code: str, message: str) -> bool:
        """Asks the run to stop: the tool is cancelled and the run ends with ``outcome``.

        Returns:
            False when the run had already ended or was already stopping.
        """
        if self.finished or self._stop is not None:
            return False
        self._stop = StopRequest(outcome, code, message)
        if self._children:
            self._stop_children(PARENT_RUN_CANCELLED if outcome is Outcome.CANCELLED
                                else PARENT_RUN_ENDED)
        if self._gated and self._main_task is not None:
            # Waiting in a gate (our own code, which honours cancellation at once).
            self._cancel_sent = True
            self._main_task.cancel(message)
        elif self._tool_running and self._main_task is not None:
            # The tool runs in the run's own task: cancelling that task cancels the tool.
            self._cancel_sent = True
            self._main_task.cancel(message)
            # A tool that swallows its cancellation must not keep the run (and every stream
            # following it) hanging: after a grace period the run ends without it.
            self._abandon_timer = asyncio.get_running_loop().call_later(
                STOP_GRACE_SECONDS, self._abandon_tool)
        return True

    def _stop_children(self, code: str) -> None:
        """Cancels the children still running (each passes it on to its own)."""
        message = ("a run above it in its call tree was cancelled" if code == PARENT_RUN_CANCELLED
                   else f"its parent run {self.run_id} ended before it")
        for child in list(self._children or ()):
            child.stop(Outcome.CANCELLED, code, message)

    def steer(self, message: str, *, source: str) -> None:
        """Hands the tool a steering message: a Notice with code ``STEERED`` and the text
        goes into the run's log (so watchers see it and WatchRun replays it), and the
        message onto the run's steering queue, which the tool reads through
        ``ctx.steering()`` / ``ctx.steering_pending()``.

        Args:
            message: The text for the tool (at most ``steer_max_bytes`` bytes of UTF-8).
            source: Who steered ("principal alice", "critic rules"), shown in the notice.

        Raises:
            InvalidArgument: The message is empty or over ``steer_max_bytes``.
            FailedPrecondition: The run has ended (reason RUN_FINISHED).
            ResourceExhausted: The run holds ``steer_max_pending`` unread messages.
        """
        check_steer_message(message, self.limits.steer_max_bytes)
        if self.finished or self._stop is not None:
            raise run_finished_error(self.run_id)
        try:
            self._steering.put_nowait(message)
        except asyncio.QueueFull:
            raise ResourceExhausted(
                f"the run already holds {self._steering.maxsize} unread steering messages",
                retry_after=self.limits.limit_retry_after_seconds,
                reason=_STEER_QUEUE_FULL, metadata={"run_id": self.run_id}) from None
        event = self._notice(STEERED, message, warning=False, source=source)
        for observer in self.observers:
            observer(event)
        # Appended at once, before the tool can read the message: the log shows the steer
        # before anything the tool does about it.
        self._append_nowait(event)

    @property
    def _steering(self) -> asyncio.Queue[str]:
        if self._steering_queue is None:
            self._steering_queue = asyncio.Queue(self.limits.steer_max_pending)
        return self._steering_queue

    async def next_steering(self) -> str:
        """Waits for the next steering message."""
        return await self._steering.get()

    def steering_pending(self) -> list[str]:
        """The steering messages not read yet, in order, taken off the queue."""
        pending: list[str] = []
        if self._steering_queue is None:
            return pending
        while not self._steering.empty():
            pending.append(self._steering.get_nowait())
        return pending

    async def wait(self) -> events_pb2.Result:
        """Waits for the run to end and returns its Result (:attr:`result`: read-only)."""
        if self.result is None:
            if self._done is None:
                self._done = asyncio.Event()
            await self._done.wait()
        assert self.result is not None
        return self.result

    async def _main(self, settings: Settings) -> None:
        started = time.monotonic()
        try:
            if self.gates:
                stopped = await self._pass_gates()
                if stopped is not None:  # ended before its START: no step ever opened
                    await self._finish(stopped, time.monotonic() - started)
                    return
                started = time.monotonic()
            self.past_gates = True
            await self.start_step(self.root_step)
            outcome = await self._run_tool(settings)
        except Exception:  # the run's own machinery broke; still end the run
            log.exception("run_machinery_failed", run_id=self.run_id, tool=self.spec.name)
            outcome = ToolResult(outcome=Outcome.ERROR, error_code="INTERNAL",
                                 error_message="the server failed while running the tool")
        if self._abandoned:
            return  # the run ended without the tool (see _abandon_tool)
        await self._finish(outcome, time.monotonic() - started)

    async def _pass_gates(self) -> ToolResult | None:
        """Passes the run's gates in order; the outcome that ends the run instead, if any
        (a gate's refusal, or a stop that came while waiting)."""
        assert self.gates is not None
        entered = time.monotonic_ns()
        self._gated = True
        try:
            for gate in self.gates:
                if self._stop is not None:
                    return self._stopped_result()
                await gate(self)
        except asyncio.CancelledError:
            if self._external_cancel():
                self._stop = self._stop or StopRequest(
                    Outcome.CANCELLED, "SERVER_SHUTDOWN", "the server is shutting down")
            return self._stopped_result()
        except ToolOutcomeError as exc:
            return classify_exception(exc)
        finally:
            self._gated = False
            self.queued_ns += time.monotonic_ns() - entered
            self.phase = PHASE_RUNNING
        if self._stop is not None:
            return self._stopped_result()
        return None

    async def _run_tool(self, settings: Settings) -> ToolResult:
        ctx = ToolContext(self, settings)
        structlog.contextvars.bind_contextvars(run_id=self.run_id, tool=self.spec.name)
        if self.parent_run_id:
            forget_callers_step()
        if self._stop is not None:  # stopped before the tool even started
            return self._stopped_result()
        spec = self.spec
        if spec.is_async:
            coro = spec.fn(ctx, self.args) if spec.takes_args else spec.fn(ctx)
        else:
            sync_ctx = SyncToolContext(ctx, asyncio.get_running_loop())
            call = (
                (lambda: spec.fn(sync_ctx, self.args)) if spec.takes_args
                else (lambda: spec.fn(sync_ctx))
            )
            coro = _in_own_thread(call, f"tool-{self.run_id}")
        if self.session is not None:
            # Calls in one session run one at a time: the tool starts once it holds its turn.
            coro = self.session.hold(coro)
        # The tool's coroutine runs in this run's own task (no task of its own, no shield:
        # a task and a future less per run). stop() cancels this task while the tool runs.
        self._tool_running = True
        try:
            value = await coro
        except asyncio.CancelledError:
            self._tool_ended()
            if not self._abandoned and self._external_cancel():
                # This run's task was cancelled from outside (the server is going down
                # hard): the tool went down with it; still end the run properly.
                self._stop = self._stop or StopRequest(
                    Outcome.CANCELLED, "SERVER_SHUTDOWN", "the server is shutting down")
            return self._stopped_result()
        except ToolOutcomeError as exc:
            await self._settle_cancel()
            return classify_exception(exc)
        except BaseException:
            # SystemExit, KeyboardInterrupt and GeneratorExit too: raised out of the run's
            # task, they would stop the event loop and end the whole server with them.
            await self._settle_cancel()
            if not self._abandoned:
                log.exception("tool_raised", run_id=self.run_id, tool=self.spec.name)
            return ToolResult(
                outcome=Outcome.ERROR, error_code="TOOL_EXCEPTION",
                error_message=f"the tool failed with an internal error (run {self.run_id})",
            )
        await self._settle_cancel()
        if self._stop is not None:
            # The tool returned even though it was asked to stop (e.g. it swallowed the
            # cancellation): the stop still decides the outcome.
            return self._stopped_result()
        try:
            return classify_return(value)
        except BaseException:  # the value's own code may raise anything (as above)
            log.exception("tool_return_unusable", run_id=self.run_id, tool=self.spec.name)
            return ToolResult(outcome=Outcome.ERROR, error_code="TOOL_BAD_RETURN",
                              error_message="the tool returned a value that cannot be sent")

    def _tool_ended(self) -> None:
        self._tool_running = False
        if self._abandon_timer is not None:
            self._abandon_timer.cancel()
            self._abandon_timer = None

    def _external_cancel(self) -> bool:
        """Takes back the cancellation :meth:`stop` sent, if any; whether this task was
        also cancelled by someone else."""
        task = self._main_task
        if task is None:
            return False
        if self._cancel_sent:
            self._cancel_sent = False
            task.uncancel()
        return task.cancelling() > 0

    async def _settle_cancel(self) -> None:
        """After the tool ended without raising CancelledError: a cancellation :meth:`stop`
        sent may not have reached it (it returned before its next await), and would then
        hit this task's next await instead. One turn of the loop takes it."""
        self._tool_ended()
        if not self._cancel_sent:
            return
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(0)
        self._external_cancel()

    def _abandon_tool(self) -> None:
        """The tool ignored its cancellation for the grace period: the run ends without
        it, in a task of its own (the run's task stays with the tool)."""
        self._abandon_timer = None
        if not self._tool_running or self.finished or self._abandoned:
            return
        self._abandoned = True
        log.warning("tool_ignored_cancellation", run_id=self.run_id,
                    tool=self.spec.name, grace_seconds=STOP_GRACE_SECONDS)
        self._finisher = asyncio.get_running_loop().create_task(
            self._finish(self._stopped_result(), time.monotonic() - self.started_monotonic),
            name=f"run-{self.run_id}-abandoned")

    def _stopped_result(self) -> ToolResult:
        stop = self._stop or StopRequest(Outcome.CANCELLED, "CANCELLED", "the run was cancelled")
        return ToolResult(outcome=stop.outcome, output="".join(self._output_tail),
                          error_code=stop.code, error_message=stop.message)

    async def _finish(self, outcome: ToolResult, duration: float) -> None:
        """Ends the run with its Result. Whatever goes wrong on the way (an observer, the
        fitting of the Result, the store), the run still ends: an ERROR Result stands in
        for one that could not be made, waiters wake and the finish hooks run, once — they
        take the run off the runtime's books and give back its concurrency permit."""
        # What every Result of the run says (the metrics read it here, not off the message).
        self.duration_ns = int(duration * 1e9)
        try:
            await self._emit_result(outcome)
        except Exception:
            log.exception("run_finish_failed", run_id=self.run_id, tool=self.spec.name)
            if self.result is None and not self.log.finished:
                result = self._fallback_result()
                # Straight into the log: an observer may be what failed.
                try:
                    self._append_nowait(events_pb2.RunEvent(result=result))
                except Exception:
                    log.exception("run_result_lost", run_id=self.run_id, tool=self.spec.name)
                self.result = result
        finally:
            if self.result is None:  # the ending broke off: whatever the log says stands
                self.result = self._ending_result()
            self._ended()

    def _ending_result(self) -> events_pb2.Result:
        """The Result of a run whose ending broke off (something failed after its Result
        was appended, or the run was cancelled on the way): the one in its log, else a
        stand-in — into the log too when that needs no waiting, so that its followers end."""
        if self.log.finished and self._result_appended is not None:
            return self._result_appended
        result = self._fallback_result()
        if not self.log.finished:
            try:
                self._append_nowait(events_pb2.RunEvent(result=result))
            except Exception:
                log.exception("run_result_lost", run_id=self.run_id, tool=self.spec.name)
        return result

    def _fallback_result(self) -> events_pb2.Result:
        result = events_pb2.Result(outcome=events_pb2.OUTCOME_ERROR)
        result.error.code = "INTERNAL"
        result.error.message = "the server failed while ending the run"
        set_duration(result.duration, self.duration_ns or 0)
        fill_usage(result.usage, self.duration_ns or 0, self._usage,
                   queued_ns=self.queued_ns, child_runs=self.child_runs)
        return result

    def _ended(self) -> None:
        """Wakes the run's waiters and runs its finish hooks (once: they are taken off)."""
        if self._done is not None:
            self._done.set()
        if self._children:  # the tool left children running: they end with it
            self._stop_children(PARENT_RUN_ENDED)
        hooks, self.finish_hooks = self.finish_hooks, []
        for hook in hooks:
            try:
                hook(self)
            except Exception:
                log.exception("finish_hook_failed", run_id=self.run_id)
        self._let_go()

    async def _emit_result(self, outcome: ToolResult) -> None:
        """Ends the open steps, streams the files chosen to stream, then appends the
        Result and sets :attr:`result`."""
        ok = outcome.outcome is Outcome.OK
        for step in reversed(list(self._open_steps.values())):
            if step is not self.root_step:
                await self.end_step(step, error=not ok)
        if outcome.error_message:
            self.root_step.summary = outcome.error_message
        await self.end_step(self.root_step, error=not ok)
        # The Result is made in its event: RunEvent(result=...) would copy it.
        event = events_pb2.RunEvent()
        self._stamp_tree(event)
        result = event.result
        # The receipt first: the fitting then counts its few bytes in the Result's room.
        fill_usage(result.usage, self.duration_ns or 0, self._usage,
                   queued_ns=self.queued_ns, child_runs=self.child_runs)
        fit = fit_result(result, outcome, self.writeback, run_id=self.run_id,
                         duration_ns=self.duration_ns or 0, sizes=self._sizes,
                         inline_file_bytes=self.limits.inline_file_bytes)
        if fit is not None:
            # The Result and the fit hold what is sent of the tool's files now: the chunks
            # in the log become the only copy of a streamed file's bytes.
            self.writeback.sent_files.clear()
            await self._stream_files(fit.files)
            if fit.oversize:
                log.error("result_too_large", run_id=self.run_id, tool=self.spec.name,
                          size=fit.oversize)
            # The notices and the Result go out without a turn of the loop between them
            # (nor after the Result): nothing can stop the run half-way through its ending.
            for code, message in fit.notices:
                await self._emit(self._notice(code, message, warning=True), may_yield=False)
        self._result_appended = result  # what the log holds if appending it is cut short
        await self._emit(event, may_yield=False)
        self.result = result

    def _let_go(self) -> None:
        """Drops what the ended run no longer needs and what would keep it in a reference
        cycle (observers and hooks hold their supervisor or span, which holds the run; the
        tool's task holds its return value or exception, whose frames hold the context):
        reference counting then frees the run as soon as nobody uses it, instead of
        whenever the cycle collector next makes a full collection."""
        self.observers.clear()  # (the finish hooks were taken off by _ended)
        if self._abandon_timer is not None:
            self._abandon_timer.cancel()
            self._abandon_timer = None
        self._open_steps.clear()
        self._step_started.clear()
        self._output_tail.clear()

    async def _stream_files(self, files: list[SentFileRecord]) -> None:
        """Sends each file of ``files`` as ordered FileChunk events (the Result lists it as
        ``streamed``), taking it off the list first: its bytes go once its chunks are in
        the log."""
        chunk_size = self.limits.file_chunk_bytes
        while files:
            record = files.pop(0)
            file_id, data = record.file_id, memoryview(record.data)
            del record
            for offset in range(0, len(data), chunk_size):
                event = events_pb2.RunEvent()
                chunk = event.file_chunk
                chunk.file_id = file_id
                chunk.offset = offset
                chunk.data = bytes(data[offset:offset + chunk_size])
                chunk.last = offset + chunk_size >= len(data)
                await self._emit(event)
            del data

    # -- events ----------------------------------------------------------------------------

    def next_step_id(self) -> str:
        """A step id unique within this run."""
        step_id = f"s{self._step_counter}"
        self._step_counter += 1
        return step_id

    def _stamp_tree(self, event: events_pb2.RunEvent) -> None:
        """Sets where the run sits in its call tree on ``event`` (its first and its last)."""
        event.root_run_id = self.root_run_id
        if self.parent_run_id:
            event.parent_run_id = self.parent_run_id

    async def start_step(self, step: ToolStep) -> None:
        """Emits the START of ``step``.

        Raises:
            RuntimeError: The step has started before (a step object is entered once: a
                second START of its id would follow its END in the stream).
        """
        if step.started:
            raise RuntimeError(f"step {step.title!r} was entered before: a step is entered "
                               "once; make a new one with ctx.step()")
        step.started = True
        event, fields, now = _step_event(events_pb2.STEP_PHASE_START, step,
                                         events_pb2.STEP_STATUS_RUNNING, self._sizes)
        if step is self.root_step:  # the run's first event
            self._stamp_tree(event)
        stamp = fields.started_at
        stamp.seconds, stamp.nanos = now
        self._open_steps[step.id] = step
        self._step_started[step.id] = now
        await self._emit(event)

    async def end_step(self, step: ToolStep, *, error: bool) -> None:
        """Emits the END of ``step`` (once; later calls do nothing)."""
        if self._open_steps.pop(step.id, None) is None:
            return
        status = events_pb2.STEP_STATUS_ERROR if error else events_pb2.STEP_STATUS_COMPLETE
        event, fields, now = _step_event(events_pb2.STEP_PHASE_END, step, status, self._sizes)
        stamp = fields.started_at
        stamp.seconds, stamp.nanos = self._step_started.pop(step.id)
        stamp = fields.ended_at
        stamp.seconds, stamp.nanos = now
        await self._emit(event)

    async def emit_delta(self, step: ToolStep, text: str, channel: str) -> None:
        """Emits partial output of ``step``: one DELTA, or several in order when ``text`` is
        larger than one event may carry."""
        if len(channel) > self._sizes.label_chars or not channel.isascii():
            channel = cut_text(channel, self._sizes.label_chars)
        for piece in split_utf8(text, self._sizes.delta_bytes):
            event = events_pb2.RunEvent()
            message = event.step
            message.phase = events_pb2.STEP_PHASE_DELTA
            message.step.id = step.id
            if step.parent_id:
                message.step.parent_id = step.parent_id
            message.delta = piece
            message.channel = channel
            self._remember_output(piece)
            await self._emit(event)

    async def emit_heartbeat(self, message: str, progress: float | None) -> None:
        """Emits a heartbeat."""
        event = events_pb2.RunEvent()
        event.heartbeat.message = cut_text(message, self._sizes.label_chars)
        if progress is not None:
            event.heartbeat.progress = progress
        await self._emit(event)

    async def emit_notice(self, code: str, message: str, *, warning: bool = True,
                          detail: Callable[[events_pb2.Notice], None] | None = None) -> None:
        """Emits a notice from the server, such as a supervisor warning.

        Args:
            detail: Sets the notice's typed detail (``queued`` of a QUEUED notice).
        """
        if self.finished:
            return
        event = self._notice(code, message, warning=warning)
        if detail is not None:
            detail(event.notice)
        await self._emit(event)

    def _notice(self, code: str, message: str, *, warning: bool, source: str = ""
                ) -> events_pb2.RunEvent:
        event = events_pb2.RunEvent()
        notice = event.notice
        notice.level = (events_pb2.NOTICE_LEVEL_WARNING if warning
                        else events_pb2.NOTICE_LEVEL_INFO)
        notice.code = cut_text(code, self._sizes.label_chars)
        notice.message = cut_text(message, self._sizes.label_chars)
        if source:
            notice.source = cut_text(source, self._sizes.label_chars)
        return event

    async def _emit(self, event: events_pb2.RunEvent, *, may_yield: bool = True) -> None:
        for observer in self.observers:
            observer(event)
        self._append_nowait(event)  # no coroutine per event
        self._emitted += 1
        if may_yield and self._emitted % YIELD_EVERY_EVENTS == 0:
            # Appending never waits, so a tool that emits without awaiting anything else
            # would hold the event loop until it returns: its own stream could not start
            # sending, and every other call would wait. Give the loop a turn now and then.
            await asyncio.sleep(0)

    def _remember_output(self, text: str) -> None:
        self._output_tail.append(text)
        self._output_tail_size += len(text)
        while self._output_tail_size > OUTPUT_TAIL_BYTES and len(self._output_tail) > 1:
            self._output_tail_size -= len(self._output_tail.pop(0))


async def _in_own_thread(call: Callable[[], Any], name: str) -> Any:
    """Runs a plain ``def`` tool in a daemon thread of its own and returns what it returns.

    Not asyncio's default executor: that pool has a handful of threads (the cores plus
    four), which the server's own work shares (sandbox working directories, the sessions'
    files, deliveries, name lookups); a few tools that never return would hold them all for
    good, and every sandboxed run and every plain ``def`` tool after them would wait until
    the critic stopped it. A daemon thread also lets the server's process exit while such a
    tool is still running, where joining the executor's threads would hang it after
    "stopped". Cancelling the await ends the run, not the thread (no thread can be
    interrupted): the function goes on until it checks ``ctx.cancelled``.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()
    context = contextvars.copy_context()

    def settle(value: Any, error: BaseException | None) -> None:
        if future.done():  # the run stopped waiting
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    def target() -> None:
        value: Any
        error: BaseException | None
        try:
            value, error = context.run(call), None
        except StopIteration as exc:
            # A future refuses StopIteration (the run would wait for its Result until the
            # hard timeout): it ends the run as any other exception, as in a coroutine.
            value, error = None, RuntimeError("the tool raised StopIteration")
            error.__cause__ = exc
        except BaseException as exc:  # handed to the run, which classifies it
            value, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits
            loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=target, name=name, daemon=True).start()
    return await future


def check_steer_message(message: str, max_bytes: int) -> None:
    """Refuses an empty steering message or one over ``max_bytes`` bytes of UTF-8.

    Raises:
        InvalidArgument: With a BadRequest violation on ``message``.
    """
    if not message.strip():
        raise InvalidArgument("the steering message is empty",
                              [FieldViolation("message", "must not be empty")])
    try:
        size = len(message.encode())
    except UnicodeEncodeError:
        raise InvalidArgument("the steering message is not valid UTF-8",
                              [FieldViolation("message", "must be valid UTF-8")]) from None
    if size > max_bytes:
        raise InvalidArgument(
            f"the steering message is {size} bytes; at most {max_bytes} are taken",
            [FieldViolation("message", f"at most {max_bytes} bytes of UTF-8 "
                                       f"(steer_max_bytes), got {size}")])


def _step_event(phase: int, step: ToolStep, status: int, sizes: EventSizes
                ) -> tuple[events_pb2.RunEvent, events_pb2.Step, tuple[int, int]]:
    """A START or END event of ``step`` stamped with the time now, with the step's fields
    (its times left for the caller to set) and that time as (seconds, nanos)."""
    event = events_pb2.RunEvent()
    # One clock reading for the event's time and the step's own, each field set directly:
    # a CopyFrom of one Timestamp into the other costs more than both.
    now = divmod(time.time_ns(), 1_000_000_000)
    stamp = event.time
    stamp.seconds, stamp.nanos = now
    message = event.step
    message.phase = phase  # type: ignore[assignment]
    fields = message.step
    _fill_step(fields, step, status, sizes)
    return event, fields, now


def _fill_step(message: events_pb2.Step, step: ToolStep, status: int, sizes: EventSizes) -> None:
    label = sizes.label_chars
    message.id = step.id
    # An empty string is a proto3 field's default: writing it would change nothing.
    if step.parent_id:
        message.parent_id = step.parent_id
    message.kind = (step.kind if len(step.kind) <= label and step.kind.isascii()
                    else cut_text(step.kind, label))
    message.title = (step.title if len(step.title) <= label and step.title.isascii()
                     else cut_text(step.title, label))
    if step.summary:
        message.summary = cut_text(step.summary, label)
    message.status = status  # type: ignore[assignment]
    if step.detail:
        size = size_with(message.detail, message.detail, step.detail)
        if size is not None and size <= sizes.detail_bytes:
            return
        message.detail.Clear()
        message.detail["omitted"] = (f"the step's detail is larger than "
                                     f"{sizes.detail_bytes} bytes")
