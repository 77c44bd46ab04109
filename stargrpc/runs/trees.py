"""Call trees: runs that call runs.

A tool calls another tool with ``await ctx.call(tool, args)`` (``ctx.call_sync`` in a plain
``def`` tool): the runtime admits a **child run** through the same pipeline as any call —
the parent's principal and its permissions, argument validation, concurrency limits,
supervision, an audit record of its own — and the parent's tool gets the child's
:class:`ChildResult`, or a :class:`ChildRunError` carrying the child's outcome. An agent
runtime hangs a call under one of its own runs with ``parent_run_id`` on Execute/StartRun.

Every run knows where it sits, carried with it and never looked up per hop:
``parent_run_id`` (empty at the top), ``root_run_id`` (its own id at the top) and ``depth``
(0 at the top). The caps are checked when a child is admitted (:func:`check_caps`):
``max_run_depth`` (FAILED_PRECONDITION ``RUN_DEPTH_EXCEEDED``), ``max_runs_per_tree``
(RESOURCE_EXHAUSTED ``RUN_TREE_FULL``) and ``max_tree_seconds`` (FAILED_PRECONDITION
``RUN_TREE_EXPIRED``; a child's supervision deadline is also the tree's).

While a child runs, its step events are relayed into its parent's log (:class:`Relay`):
marked with ``child_run_id``, step ids prefixed with the path of run ids down to it, and its
top-level step nested under the step of the parent that called it — so the parent's one
stream shows the whole tree live.

Cancelling a run cancels its children (and theirs): :meth:`stargrpc.runs.run.Run.stop`
passes the stop down; a parent that ends first cancels the children still running. A child
that fails is the parent tool's to handle (it catches :class:`ChildRunError`, or lets it end
its own run with the child's outcome).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from google.protobuf import json_format

from stargrpc.contract import Outcome
from stargrpc.errors import (
    FailedPrecondition,
    FieldViolation,
    InvalidArgument,
    RequestError,
    ResourceExhausted,
    ToolOutcomeError,
    reason_name,
)
from stargrpc.ids import minted_ms
from stargrpc.settings import Settings
from stargrpc.stores.base import RunLog, RunQuery, RunStore
from stargrpc.v1 import errors_pb2, events_pb2

#: The ``method`` of a child run's audit record (``stargrpc audit query --method Call``).
CHILD_METHOD = "/stargrpc.v1.ToolService/Call"

RUN_DEPTH_EXCEEDED = reason_name(errors_pb2.RUN_DEPTH_EXCEEDED)
RUN_TREE_FULL = reason_name(errors_pb2.RUN_TREE_FULL)
RUN_TREE_EXPIRED = reason_name(errors_pb2.RUN_TREE_EXPIRED)
PARENT_RUN_ENDED = reason_name(errors_pb2.PARENT_RUN_ENDED)
PARENT_RUN_CANCELLED = reason_name(errors_pb2.PARENT_RUN_CANCELLED)

#: Longest ``parent_run_id`` looked up; a longer one is refused INVALID_ARGUMENT (run ids
#: are 32 characters).
MAX_RUN_ID_CHARS = 64


class CallTree:
    """What the runs of one call tree in this process share: the count of runs started
    below its root, and when it started. Made when the root first has a child (most runs
    never do), handed to every run below it.

    Attributes:
        root_run_id: The root run.
        started_ms: When the root started (ms since the epoch): read from the root's id,
            which holds the time it was made, so every replica agrees without a lookup.
        runs: Runs admitted below the root in this process (refused ones not counted); a
            shared store counts them on every replica too (``RunStore.count_tree_runs``).
    """

    __slots__ = ("__weakref__", "root_run_id", "runs", "started_ms")

    def __init__(self, root_run_id: str) -> None:
        self.root_run_id = root_run_id
        minted = minted_ms(root_run_id)
        self.started_ms = minted if minted is not None else time.time_ns() // 1_000_000
        self.runs = 0

    def seconds_left(self, settings: Settings) -> float:
        """Seconds left of the tree's wall budget (``max_tree_seconds``); may be negative."""
        return settings.max_tree_seconds - (time.time_ns() // 1_000_000 - self.started_ms) / 1000


@dataclass(frozen=True)
class TreeLink:
    """Where a new run hangs in its call tree.

    Attributes:
        parent_run_id: The run it hangs under.
        root_run_id: The root of the tree.
        depth: The new run's depth (its parent's plus one).
        tree: The tree's shared count in this process.
        parent: The parent run, when it runs in this process (relay, cancel cascade).
    """

    parent_run_id: str
    root_run_id: str
    depth: int
    tree: CallTree
    parent: TreeParent | None = None


class TreeParent(Protocol):
    """What the tree needs of a parent run (:class:`stargrpc.runs.run.Run`)."""

    run_id: str
    root_run_id: str
    depth: int

    @property
    def finished(self) -> bool:
        """Whether its Result has been emitted."""
        ...

    @property
    def stop_requested(self) -> bool:
        """Whether someone asked the run to stop."""
        ...

    def call_tree(self) -> CallTree:
        """The tree the run belongs to (made on first use)."""
        ...

    def adopt(self, child: Any) -> None:
        """Keeps ``child`` to stop with the run until the child ends."""
        ...

    def relay(self, event: events_pb2.RunEvent) -> None:
        """Appends an event relayed from a child to the run's log."""
        ...


def link_under(parent: TreeParent) -> TreeLink:
    """The link of a child of ``parent``, a run of this process."""
    return TreeLink(parent.run_id, parent.root_run_id, parent.depth + 1, parent.call_tree(),
                    parent)


def check_parent_id(parent_run_id: str) -> None:
    """Refuses an over-long ``parent_run_id`` before anything looks it up.

    Raises:
        InvalidArgument: With a violation on ``parent_run_id``.
    """
    if len(parent_run_id) > MAX_RUN_ID_CHARS:
        raise InvalidArgument("parent_run_id is too long", [FieldViolation(
            "parent_run_id", f"a run id: at most {MAX_RUN_ID_CHARS} characters")])


def check_caps(link: TreeLink, settings: Settings) -> None:
    """Refuses a child that would pass one of the tree's caps, and counts it in the tree
    otherwise (give it back with :func:`uncount` when it does not start after all).

    Raises:
        FailedPrecondition: Too deep (``RUN_DEPTH_EXCEEDED``), or the tree's time is up
            (``RUN_TREE_EXPIRED``).
        ResourceExhausted: The tree has started ``max_runs_per_tree`` runs
            (``RUN_TREE_FULL``).
    """
    metadata = {"root_run_id": link.root_run_id, "parent_run_id": link.parent_run_id}
    if link.depth > settings.max_run_depth:
        raise FailedPrecondition(
            f"the run would be {link.depth} levels below its root; max_run_depth is "
            f"{settings.max_run_depth}", reason=RUN_DEPTH_EXCEEDED,
            metadata={**metadata, "depth": str(link.depth)})
    if link.tree.runs >= settings.max_runs_per_tree:
        raise ResourceExhausted(
            f"the call tree has started {link.tree.runs} runs; max_runs_per_tree is "
            f"{settings.max_runs_per_tree}", reason=RUN_TREE_FULL,
            retry_after=settings.limit_retry_after_seconds, metadata=metadata)
    if link.tree.seconds_left(settings) <= 0:
        raise FailedPrecondition(
            f"the call tree has been going for max_tree_seconds "
            f"({settings.max_tree_seconds:g} s)", reason=RUN_TREE_EXPIRED, metadata=metadata)
    link.tree.runs += 1


def uncount(link: TreeLink) -> None:
    """Gives back the place :func:`check_caps` counted for a child that did not start."""
    link.tree.runs -= 1


# -- what ctx.call returns ------------------------------------------------------------------


@dataclass(frozen=True)
class ChildFile:
    """A file a child run handed back.

    Attributes:
        name: Its name.
        mime_type: Its type.
        size: Its size in bytes.
        sha256: Hex digest of the content.
        content: The bytes (inline in the Result, or gathered from its FileChunks).
    """

    name: str
    mime_type: str
    size: int
    sha256: str
    content: bytes


@dataclass(frozen=True)
class ChildResult:
    """The Result of a child run (``ctx.call``).

    Attributes:
        run_id: The child run.
        tool: The tool it ran.
        outcome: How it ended.
        output: Its text for the model.
        structured_output: Its structured output (JSON values), None when it gave none.
        files: The files it handed back.
        error_code: Its error code when not OK.
        error_message: Its user-safe error when not OK.
        result: The Result message itself.
    """

    run_id: str
    tool: str
    outcome: Outcome
    output: str
    structured_output: Any
    files: list[ChildFile] = field(default_factory=list)
    error_code: str = ""
    error_message: str = ""
    result: events_pb2.Result | None = None

    @property
    def ok(self) -> bool:
        """Whether the child ended OK."""
        return self.outcome is Outcome.OK


def child_result(run_id: str, tool: str, result: events_pb2.Result,
                 chunks: Mapping[str, bytes]) -> ChildResult:
    """The :class:`ChildResult` of a child's Result; ``chunks`` holds the bytes of the files
    it streamed, by file id."""
    structured = (json_format.MessageToDict(result.structured_output)
                  if result.HasField("structured_output") else None)
    files = [ChildFile(sent.name, sent.mime_type, sent.size, sent.sha256,
                       chunks.get(sent.file_id, b"") if sent.streamed else sent.content)
             for sent in result.writeback.sent_files]
    return ChildResult(run_id=run_id, tool=tool,
                       outcome=Outcome(result.outcome), output=result.output,
                       structured_output=structured, files=files,
                       error_code=result.error.code, error_message=result.error.message,
                       result=result)


class ChildRunError(ToolOutcomeError):
    """A child run (``ctx.call``) ended other than OK. Uncaught, it ends the calling run
    with the child's outcome and code.

    Attributes:
        child: The child's Result (None when it was refused before it started).
        outcome: The child's outcome.
        run_id: The child run ("" when it never started).
    """

    child: ChildResult | None

    def __init__(self, message: str, *, outcome: Outcome, code: str,
                 child: ChildResult | None = None, run_id: str = "") -> None:
        # Not ToolOutcomeError.__init__: its default code is TOOL_<outcome>, and a child may
        # end TIMEOUT, ERROR or CANCELLED, which have none; the child's own code stands.
        Exception.__init__(self, message)
        self.message = message
        self.code = code or reason_name(errors_pb2.TOOL_FAILED)
        self.outcome_name = outcome.name  # read by the outcome classification
        self.outcome = outcome
        self.child = child
        self.run_id = run_id

    @classmethod
    def of(cls, child: ChildResult) -> ChildRunError:
        """The error for a child that ended other than OK."""
        why = f": {child.error_message}" if child.error_message else ""
        return cls(f"{child.tool} (run {child.run_id}) ended {child.outcome.name}{why}",
                   outcome=child.outcome, code=child.error_code, child=child,
                   run_id=child.run_id)


class ChildRunRefused(ChildRunError):
    """A child run was refused before it started: the same refusal an Execute would get,
    as a status code and reason (``RUN_DEPTH_EXCEEDED``, ``RUN_TREE_FULL``,
    ``TOOL_NOT_FOUND``, a permission, invalid arguments …). Uncaught, it ends the calling
    run FAILED (DENIED for a permission) with the reason as its code.

    Attributes:
        status: The gRPC status code of the refusal (a ``grpc.StatusCode``).
        reason: Its ErrorReason name.
    """

    def __init__(self, tool: str, error: RequestError) -> None:
        denied = error.code.name == "PERMISSION_DENIED"
        super().__init__(f"calling {tool} was refused: {error.message}",
                         outcome=Outcome.DENIED if denied else Outcome.FAILED,
                         code=error.reason)
        self.status = error.code
        self.reason = error.reason


# -- the relay of a child's events into its parent's log ------------------------------------


class Relay:
    """Observes a child run's events: copies its step events into the parent's log (see
    the module docstring) and keeps the bytes of the files it streams for its
    :class:`ChildResult`.

    Attributes:
        chunks: Streamed file bytes by file id.
    """

    __slots__ = ("_calling_step", "_child_run_id", "_parent", "_prefix", "chunks")

    def __init__(self, parent: TreeParent, child_run_id: str, calling_step_id: str) -> None:
        self._parent = parent
        self._child_run_id = child_run_id
        self._prefix = child_run_id + "/"
        self._calling_step = calling_step_id
        self.chunks: dict[str, bytes] = {}

    def __call__(self, event: events_pb2.RunEvent) -> None:
        kind = event.WhichOneof("kind")
        if kind == "file_chunk":
            chunk = event.file_chunk
            self.chunks[chunk.file_id] = self.chunks.get(chunk.file_id, b"") + chunk.data
            return
        if kind != "step" or self._parent.finished:
            return
        relayed = events_pb2.RunEvent()
        # A grandchild's event keeps the id of the run it comes from.
        relayed.child_run_id = event.child_run_id or self._child_run_id
        if event.HasField("time"):
            relayed.time.CopyFrom(event.time)
        message = relayed.step
        message.CopyFrom(event.step)
        step = message.step
        step.id = self._prefix + step.id
        step.parent_id = (self._prefix + step.parent_id if step.parent_id
                          else self._calling_step)
        self._parent.relay(relayed)


# -- what the runtime offers a run that calls -----------------------------------------------


class ChildStarter(Protocol):
    """What starts child runs: the runtime (:class:`stargrpc.runs.runtime.Runtime`)."""

    settings: Settings

    async def call_child(self, parent: Any, tool: str, arguments: Mapping[str, Any], *,
                         priority: int, timeout: float | None,  # noqa: ASYNC109
                         calling_step_id: str) -> ChildResult:
        """Runs ``tool`` as a child of ``parent`` and returns its Result.

        Raises:
            ChildRunRefused: The child was refused before it started.
            ChildRunError: The child ended other than OK.
        """
        ...


#: Writes the audit record of a child run: its call record, its Result (None when it was
#: refused) and when it was asked for (the audit's time format).
ChildAuditor = Callable[[Any, "events_pb2.Result | None", str], None]


# -- cancelling a tree across replicas ------------------------------------------------------

#: Most runs of one tree a cancel looks at (a page of ListRuns at most).
CANCEL_SCAN_RUNS = 200


async def cancel_subtree(store: RunStore, cancelled: RunLog) -> int:
    """Asks every run still going below ``cancelled`` (just cancelled) to stop, wherever it
    runs: its children in this process stop with it already (``Run.stop``); this reaches
    the runs an agent hung below it on other replicas (``parent_run_id``), through the
    store's index of its tree and the store's cancel relay.

    Returns:
        How many runs were asked to stop.
    """
    root = cancelled.root_run_id or cancelled.run_id
    page = await store.list_runs(RunQuery(owner=None, limit=CANCEL_SCAN_RUNS,
                                          root_run_id=root))
    children: dict[str, list[str]] = {}
    going = set()
    for run in page.runs:
        children.setdefault(run.parent_run_id, []).append(run.run_id)
        if not run.finished:
            going.add(run.run_id)
    below, frontier = [], [cancelled.run_id]
    while frontier:
        frontier = [child for run_id in frontier for child in children.get(run_id, ())]
        below.extend(frontier)
    asked = 0
    for run_id in below:
        if run_id in going and await store.request_cancel(
                run_id, "a run above it in its call tree was cancelled"):
            asked += 1
    return asked
