import datetime

from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from stargrpc.v1 import catalog_pb2 as _catalog_pb2
from stargrpc.v1 import events_pb2 as _events_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RunState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUN_STATE_UNSPECIFIED: _ClassVar[RunState]
    RUN_STATE_RUNNING: _ClassVar[RunState]
    RUN_STATE_FINISHED: _ClassVar[RunState]
    RUN_STATE_QUEUED: _ClassVar[RunState]
    RUN_STATE_AWAITING_APPROVAL: _ClassVar[RunState]

class ApprovalVerdict(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    APPROVAL_VERDICT_UNSPECIFIED: _ClassVar[ApprovalVerdict]
    APPROVAL_VERDICT_APPROVE: _ClassVar[ApprovalVerdict]
    APPROVAL_VERDICT_DENY: _ClassVar[ApprovalVerdict]
RUN_STATE_UNSPECIFIED: RunState
RUN_STATE_RUNNING: RunState
RUN_STATE_FINISHED: RunState
RUN_STATE_QUEUED: RunState
RUN_STATE_AWAITING_APPROVAL: RunState
APPROVAL_VERDICT_UNSPECIFIED: ApprovalVerdict
APPROVAL_VERDICT_APPROVE: ApprovalVerdict
APPROVAL_VERDICT_DENY: ApprovalVerdict

class ListToolsRequest(_message.Message):
    __slots__ = ("known_catalog_hash",)
    KNOWN_CATALOG_HASH_FIELD_NUMBER: _ClassVar[int]
    known_catalog_hash: str
    def __init__(self, known_catalog_hash: _Optional[str] = ...) -> None: ...

class ListToolsResponse(_message.Message):
    __slots__ = ("tools", "catalog_hash", "not_modified")
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    CATALOG_HASH_FIELD_NUMBER: _ClassVar[int]
    NOT_MODIFIED_FIELD_NUMBER: _ClassVar[int]
    tools: _containers.RepeatedCompositeFieldContainer[_catalog_pb2.Tool]
    catalog_hash: str
    not_modified: bool
    def __init__(self, tools: _Optional[_Iterable[_Union[_catalog_pb2.Tool, _Mapping]]] = ..., catalog_hash: _Optional[str] = ..., not_modified: _Optional[bool] = ...) -> None: ...

class WatchCatalogRequest(_message.Message):
    __slots__ = ("known_catalog_hash",)
    KNOWN_CATALOG_HASH_FIELD_NUMBER: _ClassVar[int]
    known_catalog_hash: str
    def __init__(self, known_catalog_hash: _Optional[str] = ...) -> None: ...

class WatchCatalogResponse(_message.Message):
    __slots__ = ("tools", "catalog_hash")
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    CATALOG_HASH_FIELD_NUMBER: _ClassVar[int]
    tools: _containers.RepeatedCompositeFieldContainer[_catalog_pb2.Tool]
    catalog_hash: str
    def __init__(self, tools: _Optional[_Iterable[_Union[_catalog_pb2.Tool, _Mapping]]] = ..., catalog_hash: _Optional[str] = ...) -> None: ...

class InvocationContext(_message.Message):
    __slots__ = ("end_user", "channel", "trace_id", "session_id", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    END_USER_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    end_user: str
    channel: str
    trace_id: str
    session_id: str
    labels: _containers.ScalarMap[str, str]
    def __init__(self, end_user: _Optional[str] = ..., channel: _Optional[str] = ..., trace_id: _Optional[str] = ..., session_id: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ExecuteRequest(_message.Message):
    __slots__ = ("tool_name", "arguments", "arguments_json", "idempotency_key", "catalog_hash", "context", "coalesce_deltas", "delivery", "lane", "priority", "max_wait_seconds", "parent_run_id", "session_id", "session_no_wait")
    TOOL_NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    CATALOG_HASH_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    COALESCE_DELTAS_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    MAX_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PARENT_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_NO_WAIT_FIELD_NUMBER: _ClassVar[int]
    tool_name: str
    arguments: _struct_pb2.Struct
    arguments_json: str
    idempotency_key: str
    catalog_hash: str
    context: InvocationContext
    coalesce_deltas: bool
    delivery: Delivery
    lane: str
    priority: int
    max_wait_seconds: float
    parent_run_id: str
    session_id: str
    session_no_wait: bool
    def __init__(self, tool_name: _Optional[str] = ..., arguments: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., arguments_json: _Optional[str] = ..., idempotency_key: _Optional[str] = ..., catalog_hash: _Optional[str] = ..., context: _Optional[_Union[InvocationContext, _Mapping]] = ..., coalesce_deltas: _Optional[bool] = ..., delivery: _Optional[_Union[Delivery, _Mapping]] = ..., lane: _Optional[str] = ..., priority: _Optional[int] = ..., max_wait_seconds: _Optional[float] = ..., parent_run_id: _Optional[str] = ..., session_id: _Optional[str] = ..., session_no_wait: _Optional[bool] = ...) -> None: ...

class Delivery(_message.Message):
    __slots__ = ("webhook", "redis_stream")
    WEBHOOK_FIELD_NUMBER: _ClassVar[int]
    REDIS_STREAM_FIELD_NUMBER: _ClassVar[int]
    webhook: WebhookTarget
    redis_stream: RedisStreamTarget
    def __init__(self, webhook: _Optional[_Union[WebhookTarget, _Mapping]] = ..., redis_stream: _Optional[_Union[RedisStreamTarget, _Mapping]] = ...) -> None: ...

class WebhookTarget(_message.Message):
    __slots__ = ("url",)
    URL_FIELD_NUMBER: _ClassVar[int]
    url: str
    def __init__(self, url: _Optional[str] = ...) -> None: ...

class RedisStreamTarget(_message.Message):
    __slots__ = ("stream",)
    STREAM_FIELD_NUMBER: _ClassVar[int]
    stream: str
    def __init__(self, stream: _Optional[str] = ...) -> None: ...

class ExecuteResponse(_message.Message):
    __slots__ = ("event",)
    EVENT_FIELD_NUMBER: _ClassVar[int]
    event: _events_pb2.RunEvent
    def __init__(self, event: _Optional[_Union[_events_pb2.RunEvent, _Mapping]] = ...) -> None: ...

class WatchRunRequest(_message.Message):
    __slots__ = ("run_id", "after_seq", "coalesce_deltas")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    COALESCE_DELTAS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    after_seq: int
    coalesce_deltas: bool
    def __init__(self, run_id: _Optional[str] = ..., after_seq: _Optional[int] = ..., coalesce_deltas: _Optional[bool] = ...) -> None: ...

class WatchRunResponse(_message.Message):
    __slots__ = ("event",)
    EVENT_FIELD_NUMBER: _ClassVar[int]
    event: _events_pb2.RunEvent
    def __init__(self, event: _Optional[_Union[_events_pb2.RunEvent, _Mapping]] = ...) -> None: ...

class CancelRunRequest(_message.Message):
    __slots__ = ("run_id", "reason")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    reason: str
    def __init__(self, run_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CancelRunResponse(_message.Message):
    __slots__ = ("cancelled",)
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    cancelled: bool
    def __init__(self, cancelled: _Optional[bool] = ...) -> None: ...

class SteerRunRequest(_message.Message):
    __slots__ = ("run_id", "message")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    message: str
    def __init__(self, run_id: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class SteerRunResponse(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class StartRunRequest(_message.Message):
    __slots__ = ("tool_name", "arguments", "arguments_json", "idempotency_key", "catalog_hash", "context", "delivery", "lane", "priority", "max_wait_seconds", "parent_run_id", "session_id", "session_no_wait")
    TOOL_NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    CATALOG_HASH_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    MAX_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PARENT_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_NO_WAIT_FIELD_NUMBER: _ClassVar[int]
    tool_name: str
    arguments: _struct_pb2.Struct
    arguments_json: str
    idempotency_key: str
    catalog_hash: str
    context: InvocationContext
    delivery: Delivery
    lane: str
    priority: int
    max_wait_seconds: float
    parent_run_id: str
    session_id: str
    session_no_wait: bool
    def __init__(self, tool_name: _Optional[str] = ..., arguments: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., arguments_json: _Optional[str] = ..., idempotency_key: _Optional[str] = ..., catalog_hash: _Optional[str] = ..., context: _Optional[_Union[InvocationContext, _Mapping]] = ..., delivery: _Optional[_Union[Delivery, _Mapping]] = ..., lane: _Optional[str] = ..., priority: _Optional[int] = ..., max_wait_seconds: _Optional[float] = ..., parent_run_id: _Optional[str] = ..., session_id: _Optional[str] = ..., session_no_wait: _Optional[bool] = ...) -> None: ...

class StartRunResponse(_message.Message):
    __slots__ = ("run_id", "attached")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    attached: bool
    def __init__(self, run_id: _Optional[str] = ..., attached: _Optional[bool] = ...) -> None: ...

class ListRunsRequest(_message.Message):
    __slots__ = ("page_size", "page_token", "tool_name", "state", "outcome", "root_run_id", "parent_run_id", "lane")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOOL_NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    ROOT_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    tool_name: str
    state: RunState
    outcome: _events_pb2.Outcome
    root_run_id: str
    parent_run_id: str
    lane: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., tool_name: _Optional[str] = ..., state: _Optional[_Union[RunState, str]] = ..., outcome: _Optional[_Union[_events_pb2.Outcome, str]] = ..., root_run_id: _Optional[str] = ..., parent_run_id: _Optional[str] = ..., lane: _Optional[str] = ...) -> None: ...

class RunSummary(_message.Message):
    __slots__ = ("run_id", "tool_name", "principal", "state", "outcome", "started_at", "ended_at", "last_seq", "current_step", "lane", "priority", "queue_position", "approval", "parent_run_id", "root_run_id", "depth")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_NAME_FIELD_NUMBER: _ClassVar[int]
    PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    CURRENT_STEP_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    QUEUE_POSITION_FIELD_NUMBER: _ClassVar[int]
    APPROVAL_FIELD_NUMBER: _ClassVar[int]
    PARENT_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROOT_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    tool_name: str
    principal: str
    state: RunState
    outcome: _events_pb2.Outcome
    started_at: _timestamp_pb2.Timestamp
    ended_at: _timestamp_pb2.Timestamp
    last_seq: int
    current_step: str
    lane: str
    priority: int
    queue_position: int
    approval: _events_pb2.ApprovalRequest
    parent_run_id: str
    root_run_id: str
    depth: int
    def __init__(self, run_id: _Optional[str] = ..., tool_name: _Optional[str] = ..., principal: _Optional[str] = ..., state: _Optional[_Union[RunState, str]] = ..., outcome: _Optional[_Union[_events_pb2.Outcome, str]] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., ended_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., last_seq: _Optional[int] = ..., current_step: _Optional[str] = ..., lane: _Optional[str] = ..., priority: _Optional[int] = ..., queue_position: _Optional[int] = ..., approval: _Optional[_Union[_events_pb2.ApprovalRequest, _Mapping]] = ..., parent_run_id: _Optional[str] = ..., root_run_id: _Optional[str] = ..., depth: _Optional[int] = ...) -> None: ...

class ListRunsResponse(_message.Message):
    __slots__ = ("runs", "next_page_token")
    RUNS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedCompositeFieldContainer[RunSummary]
    next_page_token: str
    def __init__(self, runs: _Optional[_Iterable[_Union[RunSummary, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class ApproveRunRequest(_message.Message):
    __slots__ = ("run_id", "approval_id", "decision", "reason", "arguments_digest")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    APPROVAL_ID_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    approval_id: str
    decision: ApprovalVerdict
    reason: str
    arguments_digest: str
    def __init__(self, run_id: _Optional[str] = ..., approval_id: _Optional[str] = ..., decision: _Optional[_Union[ApprovalVerdict, str]] = ..., reason: _Optional[str] = ..., arguments_digest: _Optional[str] = ...) -> None: ...

class ApproveRunResponse(_message.Message):
    __slots__ = ("run_id", "decision", "arguments_digest")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    decision: ApprovalVerdict
    arguments_digest: str
    def __init__(self, run_id: _Optional[str] = ..., decision: _Optional[_Union[ApprovalVerdict, str]] = ..., arguments_digest: _Optional[str] = ...) -> None: ...

class CreateSessionRequest(_message.Message):
    __slots__ = ("kind", "ttl_seconds", "idle_seconds", "memory_mb", "cpu_seconds", "disk_mb")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MB_FIELD_NUMBER: _ClassVar[int]
    CPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DISK_MB_FIELD_NUMBER: _ClassVar[int]
    kind: str
    ttl_seconds: int
    idle_seconds: int
    memory_mb: int
    cpu_seconds: int
    disk_mb: int
    def __init__(self, kind: _Optional[str] = ..., ttl_seconds: _Optional[int] = ..., idle_seconds: _Optional[int] = ..., memory_mb: _Optional[int] = ..., cpu_seconds: _Optional[int] = ..., disk_mb: _Optional[int] = ...) -> None: ...

class CreateSessionResponse(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: Session
    def __init__(self, session: _Optional[_Union[Session, _Mapping]] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ("with_files",)
    WITH_FILES_FIELD_NUMBER: _ClassVar[int]
    with_files: bool
    def __init__(self, with_files: _Optional[bool] = ...) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[Session]
    def __init__(self, sessions: _Optional[_Iterable[_Union[Session, _Mapping]]] = ...) -> None: ...

class Session(_message.Message):
    __slots__ = ("session_id", "kind", "created_at", "expires_at", "last_used_at", "idle_seconds", "memory_mb", "cpu_seconds", "disk_mb", "calls", "busy", "usage", "files")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_AT_FIELD_NUMBER: _ClassVar[int]
    IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MB_FIELD_NUMBER: _ClassVar[int]
    CPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DISK_MB_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    kind: str
    created_at: _timestamp_pb2.Timestamp
    expires_at: _timestamp_pb2.Timestamp
    last_used_at: _timestamp_pb2.Timestamp
    idle_seconds: int
    memory_mb: int
    cpu_seconds: int
    disk_mb: int
    calls: int
    busy: bool
    usage: _events_pb2.Usage
    files: _containers.RepeatedCompositeFieldContainer[SessionFile]
    def __init__(self, session_id: _Optional[str] = ..., kind: _Optional[str] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., last_used_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., idle_seconds: _Optional[int] = ..., memory_mb: _Optional[int] = ..., cpu_seconds: _Optional[int] = ..., disk_mb: _Optional[int] = ..., calls: _Optional[int] = ..., busy: _Optional[bool] = ..., usage: _Optional[_Union[_events_pb2.Usage, _Mapping]] = ..., files: _Optional[_Iterable[_Union[SessionFile, _Mapping]]] = ...) -> None: ...

class SessionFile(_message.Message):
    __slots__ = ("name", "size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...
