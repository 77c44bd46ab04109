import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import struct_pb2 as _struct_pb2
from stargrpc.v1 import events_pb2 as _events_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SuperviseRequest(_message.Message):
    __slots__ = ("start", "event", "ask")
    START_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    ASK_FIELD_NUMBER: _ClassVar[int]
    start: RunStart
    event: _events_pb2.RunEvent
    ask: Ask
    def __init__(self, start: _Optional[_Union[RunStart, _Mapping]] = ..., event: _Optional[_Union[_events_pb2.RunEvent, _Mapping]] = ..., ask: _Optional[_Union[Ask, _Mapping]] = ...) -> None: ...

class RunStart(_message.Message):
    __slots__ = ("run_id", "tool_name", "arguments", "principal", "soft_timeout", "hard_timeout", "caller_deadline")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    SOFT_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    HARD_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    CALLER_DEADLINE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    tool_name: str
    arguments: _struct_pb2.Struct
    principal: str
    soft_timeout: _duration_pb2.Duration
    hard_timeout: _duration_pb2.Duration
    caller_deadline: _duration_pb2.Duration
    def __init__(self, run_id: _Optional[str] = ..., tool_name: _Optional[str] = ..., arguments: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., principal: _Optional[str] = ..., soft_timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., hard_timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., caller_deadline: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class Ask(_message.Message):
    __slots__ = ("idle",)
    IDLE_FIELD_NUMBER: _ClassVar[int]
    idle: _duration_pb2.Duration
    def __init__(self, idle: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class SuperviseResponse(_message.Message):
    __slots__ = ("extend", "warn", "steer", "stop", "keep")
    EXTEND_FIELD_NUMBER: _ClassVar[int]
    WARN_FIELD_NUMBER: _ClassVar[int]
    STEER_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    extend: Extend
    warn: Warn
    steer: Steer
    stop: Stop
    keep: Keep
    def __init__(self, extend: _Optional[_Union[Extend, _Mapping]] = ..., warn: _Optional[_Union[Warn, _Mapping]] = ..., steer: _Optional[_Union[Steer, _Mapping]] = ..., stop: _Optional[_Union[Stop, _Mapping]] = ..., keep: _Optional[_Union[Keep, _Mapping]] = ...) -> None: ...

class Extend(_message.Message):
    __slots__ = ("within", "reason")
    WITHIN_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    within: _duration_pb2.Duration
    reason: str
    def __init__(self, within: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., reason: _Optional[str] = ...) -> None: ...

class Warn(_message.Message):
    __slots__ = ("message",)
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    message: str
    def __init__(self, message: _Optional[str] = ...) -> None: ...

class Steer(_message.Message):
    __slots__ = ("message",)
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    message: str
    def __init__(self, message: _Optional[str] = ...) -> None: ...

class Stop(_message.Message):
    __slots__ = ("code", "reason")
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    code: str
    reason: str
    def __init__(self, code: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class Keep(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
