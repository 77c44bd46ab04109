import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StepPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STEP_PHASE_UNSPECIFIED: _ClassVar[StepPhase]
    STEP_PHASE_START: _ClassVar[StepPhase]
    STEP_PHASE_DELTA: _ClassVar[StepPhase]
    STEP_PHASE_END: _ClassVar[StepPhase]

class StepStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STEP_STATUS_UNSPECIFIED: _ClassVar[StepStatus]
    STEP_STATUS_RUNNING: _ClassVar[StepStatus]
    STEP_STATUS_COMPLETE: _ClassVar[StepStatus]
    STEP_STATUS_ERROR: _ClassVar[StepStatus]

class NoticeLevel(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NOTICE_LEVEL_UNSPECIFIED: _ClassVar[NoticeLevel]
    NOTICE_LEVEL_INFO: _ClassVar[NoticeLevel]
    NOTICE_LEVEL_WARNING: _ClassVar[NoticeLevel]

class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTCOME_UNSPECIFIED: _ClassVar[Outcome]
    OUTCOME_OK: _ClassVar[Outcome]
    OUTCOME_DENIED: _ClassVar[Outcome]
    OUTCOME_FAILED: _ClassVar[Outcome]
    OUTCOME_ERROR: _ClassVar[Outcome]
    OUTCOME_TIMEOUT: _ClassVar[Outcome]
    OUTCOME_CANCELLED: _ClassVar[Outcome]
STEP_PHASE_UNSPECIFIED: StepPhase
STEP_PHASE_START: StepPhase
STEP_PHASE_DELTA: StepPhase
STEP_PHASE_END: StepPhase
STEP_STATUS_UNSPECIFIED: StepStatus
STEP_STATUS_RUNNING: StepStatus
STEP_STATUS_COMPLETE: StepStatus
STEP_STATUS_ERROR: StepStatus
NOTICE_LEVEL_UNSPECIFIED: NoticeLevel
NOTICE_LEVEL_INFO: NoticeLevel
NOTICE_LEVEL_WARNING: NoticeLevel
OUTCOME_UNSPECIFIED: Outcome
OUTCOME_OK: Outcome
OUTCOME_DENIED: Outcome
OUTCOME_FAILED: Outcome
OUTCOME_ERROR: Outcome
OUTCOME_TIMEOUT: Outcome
OUTCOME_CANCELLED: Outcome

class RunEvent(_message.Message):
    __slots__ = ("run_id", "seq", "time", "critic_time_left", "first_seq", "child_run_id", "parent_run_id", "root_run_id", "step", "heartbeat", "notice", "file_chunk", "result")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    CRITIC_TIME_LEFT_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEQ_FIELD_NUMBER: _ClassVar[int]
    CHILD_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROOT_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    NOTICE_FIELD_NUMBER: _ClassVar[int]
    FILE_CHUNK_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    seq: int
    time: _timestamp_pb2.Timestamp
    critic_time_left: _duration_pb2.Duration
    first_seq: int
    child_run_id: str
    parent_run_id: str
    root_run_id: str
    step: StepEvent
    heartbeat: Heartbeat
    notice: Notice
    file_chunk: FileChunk
    result: Result
    def __init__(self, run_id: _Optional[str] = ..., seq: _Optional[int] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., critic_time_left: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., first_seq: _Optional[int] = ..., child_run_id: _Optional[str] = ..., parent_run_id: _Optional[str] = ..., root_run_id: _Optional[str] = ..., step: _Optional[_Union[StepEvent, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., notice: _Optional[_Union[Notice, _Mapping]] = ..., file_chunk: _Optional[_Union[FileChunk, _Mapping]] = ..., result: _Optional[_Union[Result, _Mapping]] = ...) -> None: ...

class Step(_message.Message):
    __slots__ = ("id", "parent_id", "kind", "title", "summary", "status", "detail", "started_at", "ended_at")
    ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TITLE_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    id: str
    parent_id: str
    kind: str
    title: str
    summary: str
    status: StepStatus
    detail: _struct_pb2.Struct
    started_at: _timestamp_pb2.Timestamp
    ended_at: _timestamp_pb2.Timestamp
    def __init__(self, id: _Optional[str] = ..., parent_id: _Optional[str] = ..., kind: _Optional[str] = ..., title: _Optional[str] = ..., summary: _Optional[str] = ..., status: _Optional[_Union[StepStatus, str]] = ..., detail: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., ended_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class StepEvent(_message.Message):
    __slots__ = ("phase", "step", "delta", "channel")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    phase: StepPhase
    step: Step
    delta: str
    channel: str
    def __init__(self, phase: _Optional[_Union[StepPhase, str]] = ..., step: _Optional[_Union[Step, _Mapping]] = ..., delta: _Optional[str] = ..., channel: _Optional[str] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("message", "progress")
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    message: str
    progress: float
    def __init__(self, message: _Optional[str] = ..., progress: _Optional[float] = ...) -> None: ...

class Notice(_message.Message):
    __slots__ = ("level", "code", "message", "source", "queued", "approval", "approval_decision")
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    APPROVAL_FIELD_NUMBER: _ClassVar[int]
    APPROVAL_DECISION_FIELD_NUMBER: _ClassVar[int]
    level: NoticeLevel
    code: str
    message: str
    source: str
    queued: LaneQueued
    approval: ApprovalRequest
    approval_decision: ApprovalDecision
    def __init__(self, level: _Optional[_Union[NoticeLevel, str]] = ..., code: _Optional[str] = ..., message: _Optional[str] = ..., source: _Optional[str] = ..., queued: _Optional[_Union[LaneQueued, _Mapping]] = ..., approval: _Optional[_Union[ApprovalRequest, _Mapping]] = ..., approval_decision: _Optional[_Union[ApprovalDecision, _Mapping]] = ...) -> None: ...

class ApprovalRequest(_message.Message):
    __slots__ = ("approval_id", "tool_name", "principal", "arguments_digest", "arguments", "requested_at", "deadline")
    APPROVAL_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_NAME_FIELD_NUMBER: _ClassVar[int]
    PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_AT_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    approval_id: str
    tool_name: str
    principal: str
    arguments_digest: str
    arguments: str
    requested_at: _timestamp_pb2.Timestamp
    deadline: _timestamp_pb2.Timestamp
    def __init__(self, approval_id: _Optional[str] = ..., tool_name: _Optional[str] = ..., principal: _Optional[str] = ..., arguments_digest: _Optional[str] = ..., arguments: _Optional[str] = ..., requested_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., deadline: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ApprovalDecision(_message.Message):
    __slots__ = ("approver", "reason", "decided_at")
    APPROVER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DECIDED_AT_FIELD_NUMBER: _ClassVar[int]
    approver: str
    reason: str
    decided_at: _timestamp_pb2.Timestamp
    def __init__(self, approver: _Optional[str] = ..., reason: _Optional[str] = ..., decided_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class LaneQueued(_message.Message):
    __slots__ = ("lane", "position", "estimated_wait", "priority")
    LANE_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_WAIT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    lane: str
    position: int
    estimated_wait: _duration_pb2.Duration
    priority: int
    def __init__(self, lane: _Optional[str] = ..., position: _Optional[int] = ..., estimated_wait: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., priority: _Optional[int] = ...) -> None: ...

class FileChunk(_message.Message):
    __slots__ = ("file_id", "offset", "data", "last")
    FILE_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    file_id: str
    offset: int
    data: bytes
    last: bool
    def __init__(self, file_id: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ...) -> None: ...

class ResultError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class Result(_message.Message):
    __slots__ = ("outcome", "output", "structured_output", "error", "duration", "writeback", "usage")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DURATION_FIELD_NUMBER: _ClassVar[int]
    WRITEBACK_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    outcome: Outcome
    output: str
    structured_output: _struct_pb2.Value
    error: ResultError
    duration: _duration_pb2.Duration
    writeback: WriteBack
    usage: Usage
    def __init__(self, outcome: _Optional[_Union[Outcome, str]] = ..., output: _Optional[str] = ..., structured_output: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ..., error: _Optional[_Union[ResultError, _Mapping]] = ..., duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., writeback: _Optional[_Union[WriteBack, _Mapping]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("wall_seconds", "queued_seconds", "cpu_user_seconds", "cpu_system_seconds", "peak_rss_bytes", "bytes_written", "network_bytes_sent", "network_bytes_received", "child_runs")
    WALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CPU_USER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CPU_SYSTEM_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PEAK_RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    NETWORK_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    NETWORK_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    CHILD_RUNS_FIELD_NUMBER: _ClassVar[int]
    wall_seconds: float
    queued_seconds: float
    cpu_user_seconds: float
    cpu_system_seconds: float
    peak_rss_bytes: int
    bytes_written: int
    network_bytes_sent: int
    network_bytes_received: int
    child_runs: int
    def __init__(self, wall_seconds: _Optional[float] = ..., queued_seconds: _Optional[float] = ..., cpu_user_seconds: _Optional[float] = ..., cpu_system_seconds: _Optional[float] = ..., peak_rss_bytes: _Optional[int] = ..., bytes_written: _Optional[int] = ..., network_bytes_sent: _Optional[int] = ..., network_bytes_received: _Optional[int] = ..., child_runs: _Optional[int] = ...) -> None: ...

class WriteBack(_message.Message):
    __slots__ = ("sent_files", "injected_tools", "sent_rich_messages")
    SENT_FILES_FIELD_NUMBER: _ClassVar[int]
    INJECTED_TOOLS_FIELD_NUMBER: _ClassVar[int]
    SENT_RICH_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    sent_files: _containers.RepeatedCompositeFieldContainer[SentFile]
    injected_tools: _containers.RepeatedCompositeFieldContainer[InjectedTool]
    sent_rich_messages: _containers.RepeatedCompositeFieldContainer[RichMessage]
    def __init__(self, sent_files: _Optional[_Iterable[_Union[SentFile, _Mapping]]] = ..., injected_tools: _Optional[_Iterable[_Union[InjectedTool, _Mapping]]] = ..., sent_rich_messages: _Optional[_Iterable[_Union[RichMessage, _Mapping]]] = ...) -> None: ...

class SentFile(_message.Message):
    __slots__ = ("file_id", "name", "mime_type", "size", "sha256", "content", "streamed")
    FILE_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    STREAMED_FIELD_NUMBER: _ClassVar[int]
    file_id: str
    name: str
    mime_type: str
    size: int
    sha256: str
    content: bytes
    streamed: bool
    def __init__(self, file_id: _Optional[str] = ..., name: _Optional[str] = ..., mime_type: _Optional[str] = ..., size: _Optional[int] = ..., sha256: _Optional[str] = ..., content: _Optional[bytes] = ..., streamed: _Optional[bool] = ...) -> None: ...

class InjectedTool(_message.Message):
    __slots__ = ("name", "description", "input_schema")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    INPUT_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    input_schema: _struct_pb2.Struct
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., input_schema: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class RichMessage(_message.Message):
    __slots__ = ("kind", "payload")
    KIND_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    kind: str
    payload: _struct_pb2.Struct
    def __init__(self, kind: _Optional[str] = ..., payload: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...
