"""Typed views of the contract's messages: run events, the Result and catalog entries.

Each event keeps the protobuf message it was built from as ``raw``, so nothing the server
sent is out of reach, while the common fields read as plain Python values.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format
from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp

from stargrpc.client.errors import ClientError
from stargrpc.contract import Outcome
from stargrpc.v1 import catalog_pb2, events_pb2


def _time(stamp: Timestamp, present: bool) -> dt.datetime | None:
    return stamp.ToDatetime(tzinfo=dt.UTC) if present else None


def _seconds(duration: Duration) -> float:
    return duration.ToNanoseconds() / 1e9


@dataclass(frozen=True, kw_only=True)
class Step:
    """A unit of visible work inside a run; the tool call itself is the top-level step.

    Attributes:
        id: Step id, unique within the run.
        parent_id: The enclosing step; empty for the top-level step.
        kind: A short family name.
        title: What the step does.
        summary: A one-line summary, usually set when the step ends.
        status: ``"RUNNING"``, ``"COMPLETE"`` or ``"ERROR"``.
        detail: Free-form structured details.
        started_at: When the step started.
        ended_at: When it ended, once it has.
    """

    id: str
    parent_id: str
    kind: str
    title: str
    summary: str
    status: str
    detail: dict[str, Any]
    started_at: dt.datetime | None
    ended_at: dt.datetime | None

    @classmethod
    def from_proto(cls, step: events_pb2.Step) -> Step:
        """The typed view of a ``stargrpc.v1.Step``."""
        return cls(id=step.id, parent_id=step.parent_id, kind=step.kind, title=step.title,
                   summary=step.summary,
                   status=events_pb2.StepStatus.Name(step.status).removeprefix("STEP_STATUS_"),
                   detail=json_format.MessageToDict(step.detail),
                   started_at=_time(step.started_at, step.HasField("started_at")),
                   ended_at=_time(step.ended_at, step.HasField("ended_at")))


@dataclass(frozen=True, kw_only=True)
class Event:
    """One event of a run, as Execute and WatchRun stream them.

    Attributes:
        run_id: The run.
        seq: Position in the run's log: 1, 2, 3, ... without gaps.
        time: When the server recorded it.
        critic_time_left: Seconds before the supervisor stops the run for lack of
            progress; None when the run is not supervised.
        child_run_id: Set on an event relayed from a run this run started (``ctx.call``):
            the run it comes from; its step ids are prefixed with the path of run ids down
            to it, so they never clash with the run's own.
        parent_run_id: The run that started this one (set on a run's first event and its
            Result; empty for a top-level run).
        root_run_id: The root of the run's call tree (set on its first event and its
            Result: its own id for a top-level run).
        raw: The ``stargrpc.v1.RunEvent`` itself.
    """

    run_id: str
    seq: int
    time: dt.datetime | None
    critic_time_left: float | None
    child_run_id: str = ""
    parent_run_id: str = ""
    root_run_id: str = ""
    raw: events_pb2.RunEvent = field(repr=False, compare=False)


@dataclass(frozen=True, kw_only=True)
class StepStarted(Event):
    """A step began."""

    step: Step


@dataclass(frozen=True, kw_only=True)
class StepDelta(Event):
    """A step produced partial output.

    Attributes:
        text: The output.
        channel: Which output it belongs to ("stdout", "stderr"); empty for plain text.
    """

    step: Step
    text: str
    channel: str


@dataclass(frozen=True, kw_only=True)
class StepEnded(Event):
    """A step ended; ``step.status`` says how."""

    step: Step


@dataclass(frozen=True, kw_only=True)
class Heartbeat(Event):
    """A sign of life, with the tool's progress (0..1) when it knows it."""

    message: str
    progress: float | None


@dataclass(frozen=True, kw_only=True)
class LaneQueued:
    """Where a queued run waits (the detail of a ``QUEUED`` notice).

    Attributes:
        lane: The lane.
        position: How many runs start before it, plus one (1 = next).
        estimated_wait: Seconds it is expected to wait from the notice on (0: unknown yet).
        priority: Its priority in the lane.
    """

    lane: str
    position: int
    estimated_wait: float
    priority: int


@dataclass(frozen=True, kw_only=True)
class Notice(Event):
    """A message from the server about the run, such as a supervisor warning.

    Attributes:
        level: ``"INFO"`` or ``"WARNING"``.
        code: A stable code such as ``"CRITIC_NO_PROGRESS"``.
        source: Who caused it, when someone did (for ``STEERED``: who steered).
        queued: For code ``QUEUED``: where the run waits in its lane.
    """

    level: str
    code: str
    message: str
    source: str = ""
    queued: LaneQueued | None = None


@dataclass(frozen=True, kw_only=True)
class FileChunk(Event):
    """A piece of a large file; the Result lists the file with ``streamed`` set."""

    file_id: str
    offset: int
    data: bytes
    last: bool


@dataclass(frozen=True, kw_only=True)
class SentFile:
    """A file the tool produced. ``content`` is empty when it travelled as FileChunks."""

    file_id: str
    name: str
    mime_type: str
    size: int
    sha256: str
    content: bytes
    streamed: bool


@dataclass(frozen=True, kw_only=True)
class InjectedTool:
    """A tool the run wants added to the agent's palette."""

    name: str
    description: str
    input_schema: dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class RichMessage:
    """A rich message the tool posted, such as a card."""

    kind: str
    payload: dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class Usage:
    """What a run used: its receipt (``Result.usage``). A figure is None when the run did not
    measure it — never a stand-in zero (see the contract's ``Usage`` for which runs measure
    what, and what each measure misses).

    Attributes:
        wall_seconds: Wall-clock seconds of the run.
        queued_seconds: Seconds it waited between admission and start.
        cpu_user_seconds: User-mode CPU seconds of its process tree (sandboxed runs).
        cpu_system_seconds: Kernel-mode CPU seconds of its process tree.
        peak_rss_bytes: Peak resident memory of the largest process of its tree.
        bytes_written: Storage taken by the files it left in its working directory.
        network_bytes_sent: Bytes it sent over the network through the server.
        network_bytes_received: Bytes it received over the network through the server.
        child_runs: Runs it started.
    """

    wall_seconds: float | None = None
    queued_seconds: float | None = None
    cpu_user_seconds: float | None = None
    cpu_system_seconds: float | None = None
    peak_rss_bytes: int | None = None
    bytes_written: int | None = None
    network_bytes_sent: int | None = None
    network_bytes_received: int | None = None
    child_runs: int | None = None

    @property
    def cpu_seconds(self) -> float | None:
        """User and kernel CPU seconds together, when measured."""
        if self.cpu_user_seconds is None and self.cpu_system_seconds is None:
            return None
        return (self.cpu_user_seconds or 0.0) + (self.cpu_system_seconds or 0.0)

    @classmethod
    def from_proto(cls, usage: events_pb2.Usage) -> Usage:
        """The typed view of a ``stargrpc.v1.Usage`` (its unset fields None)."""
        return cls(**{field.name: value for field, value in usage.ListFields()})


@dataclass(frozen=True, kw_only=True)
class Result(Event):
    """The last event of every run.

    Attributes:
        outcome: How the run ended.
        output: Text for the model.
        structured_output: JSON-ready structured output, or None.
        error_code: A stable code when the outcome is not OK; else empty.
        error_message: A user-safe reason when the outcome is not OK; else empty.
        duration: Wall time of the run in seconds.
        files: Files the tool sent back.
        injected_tools: Tools the run wants injected.
        rich_messages: Rich messages the tool posted.
        usage: What the run used, or None from a server that sends no receipt.
    """

    outcome: Outcome
    output: str
    structured_output: Any
    error_code: str
    error_message: str
    duration: float
    files: list[SentFile]
    injected_tools: list[InjectedTool]
    rich_messages: list[RichMessage]
    usage: Usage | None = None

    @property
    def ok(self) -> bool:
        """Whether the outcome is OK."""
        return self.outcome is Outcome.OK

    def raise_for_outcome(self) -> Result:
        """Returns the Result when it is OK.

        Raises:
            ToolRunError: The outcome is anything but OK.
        """
        if not self.ok:
            raise ToolRunError(self)
        return self


class ToolRunError(ClientError):
    """Raised by :meth:`Result.raise_for_outcome` for an outcome other than OK."""

    def __init__(self, result: Result) -> None:
        detail = result.error_message or result.output
        super().__init__(f"{result.outcome.name}: {result.error_code or ''} {detail}".strip())
        self.result = result


@dataclass(frozen=True, kw_only=True)
class ToolInfo:
    """One entry of the catalog.

    Attributes:
        name: What to pass to ``execute``.
        description: What the tool does.
        input_schema: JSON Schema of the arguments.
        output_schema: JSON Schema of the structured output, when declared.
        kind: A short family name.
        categories: Free-form categories.
        privileged: The tool needs an explicit privileged role.
        callable: Whether the caller may run it.
        read_only: Hint: changes nothing outside itself.
        destructive: Hint: may delete or overwrite data.
        idempotent: Hint: calling twice has the effect of calling once.
        open_world: Hint: reaches systems outside the server.
        raw: The ``stargrpc.v1.Tool`` itself.
    """

    name: str
    description: str
    input_schema: dict[str, Any]
    output_schema: dict[str, Any] | None
    kind: str
    categories: list[str]
    privileged: bool
    callable: bool
    read_only: bool
    destructive: bool
    idempotent: bool
    open_world: bool
    raw: catalog_pb2.Tool = field(repr=False, compare=False)

    @classmethod
    def from_proto(cls, tool: catalog_pb2.Tool) -> ToolInfo:
        """The typed view of a ``stargrpc.v1.Tool``."""
        hints = tool.annotations
        return cls(
            name=tool.name, description=tool.description,
            input_schema=json_format.MessageToDict(tool.input_schema),
            output_schema=(json_format.MessageToDict(tool.output_schema)
                           if tool.HasField("output_schema") else None),
            kind=tool.kind, categories=list(tool.categories),
            privileged=tool.permissions.privileged, callable=tool.permissions.callable,
            read_only=hints.read_only, destructive=hints.destructive,
            idempotent=hints.idempotent, open_world=hints.open_world, raw=tool)


@dataclass(frozen=True, kw_only=True)
class Catalog:
    """The tools a server offers the caller, and the catalog's hash."""

    tools: list[ToolInfo]
    catalog_hash: str

    def __getitem__(self, name: str) -> ToolInfo:
        for item in self.tools:
            if item.name == name:
                return item
        raise KeyError(name)

    def __contains__(self, name: object) -> bool:
        return any(item.name == name for item in self.tools)

    @property
    def names(self) -> list[str]:
        """The tool names, in catalog order."""
        return [item.name for item in self.tools]


def _result(event: events_pb2.RunEvent, common: dict[str, Any]) -> Result:
    result = event.result
    writeback = result.writeback
    structured = (json_format.MessageToDict(result.structured_output)
                  if result.HasField("structured_output") else None)
    return Result(
        **common,
        outcome=Outcome(result.outcome) if result.outcome else Outcome.ERROR,
        output=result.output, structured_output=structured,
        error_code=result.error.code, error_message=result.error.message,
        duration=_seconds(result.duration),
        files=[SentFile(file_id=f.file_id, name=f.name, mime_type=f.mime_type, size=f.size,
                        sha256=f.sha256, content=f.content, streamed=f.streamed)
               for f in writeback.sent_files],
        injected_tools=[InjectedTool(name=t.name, description=t.description,
                                     input_schema=json_format.MessageToDict(t.input_schema))
                        for t in writeback.injected_tools],
        rich_messages=[RichMessage(kind=m.kind, payload=json_format.MessageToDict(m.payload))
                       for m in writeback.sent_rich_messages],
        usage=Usage.from_proto(result.usage) if result.HasField("usage") else None,
    )


def event_from_proto(event: events_pb2.RunEvent) -> Event:
    """The typed view of a ``stargrpc.v1.RunEvent``.

    An event of a kind this client does not know yet (a newer server) comes back as a
    plain :class:`Event`, so old clients keep working.
    """
    common: dict[str, Any] = {
        "run_id": event.run_id, "seq": event.seq,
        "time": _time(event.time, event.HasField("time")),
        "critic_time_left": (_seconds(event.critic_time_left)
                             if event.HasField("critic_time_left") else None),
        "child_run_id": event.child_run_id, "parent_run_id": event.parent_run_id,
        "root_run_id": event.root_run_id,
        "raw": event,
    }
    kind = event.WhichOneof("kind")
    if kind == "step":
        step_event = event.step
        step = Step.from_proto(step_event.step)
        if step_event.phase == events_pb2.STEP_PHASE_START:
            return StepStarted(**common, step=step)
        if step_event.phase == events_pb2.STEP_PHASE_DELTA:
            return StepDelta(**common, step=step, text=step_event.delta,
                             channel=step_event.channel)
        if step_event.phase == events_pb2.STEP_PHASE_END:
            return StepEnded(**common, step=step)
    elif kind == "heartbeat":
        beat = event.heartbeat
        return Heartbeat(**common, message=beat.message,
                         progress=beat.progress if beat.HasField("progress") else None)
    elif kind == "notice":
        notice = event.notice
        queued = None
        if notice.HasField("queued"):
            place = notice.queued
            queued = LaneQueued(lane=place.lane, position=place.position,
                                estimated_wait=_seconds(place.estimated_wait),
                                priority=place.priority)
        return Notice(**common,
                      level=events_pb2.NoticeLevel.Name(notice.level).removeprefix("NOTICE_LEVEL_"),
                      code=notice.code, message=notice.message, source=notice.source,
                      queued=queued)
    elif kind == "file_chunk":
        chunk = event.file_chunk
        return FileChunk(**common, file_id=chunk.file_id, offset=chunk.offset, data=chunk.data,
                         last=chunk.last)
    elif kind == "result":
        return _result(event, common)
    return Event(**common)
