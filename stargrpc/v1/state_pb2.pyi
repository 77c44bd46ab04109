from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StateScope(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATE_SCOPE_UNSPECIFIED: _ClassVar[StateScope]
    STATE_SCOPE_RUN: _ClassVar[StateScope]
    STATE_SCOPE_TREE: _ClassVar[StateScope]
    STATE_SCOPE_PRINCIPAL: _ClassVar[StateScope]
    STATE_SCOPE_GLOBAL: _ClassVar[StateScope]
STATE_SCOPE_UNSPECIFIED: StateScope
STATE_SCOPE_RUN: StateScope
STATE_SCOPE_TREE: StateScope
STATE_SCOPE_PRINCIPAL: StateScope
STATE_SCOPE_GLOBAL: StateScope

class StateScopeRef(_message.Message):
    __slots__ = ("scope", "run_id", "principal")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    scope: StateScope
    run_id: str
    principal: str
    def __init__(self, scope: _Optional[_Union[StateScope, str]] = ..., run_id: _Optional[str] = ..., principal: _Optional[str] = ...) -> None: ...

class GetStateRequest(_message.Message):
    __slots__ = ("scope", "key")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    scope: StateScopeRef
    key: str
    def __init__(self, scope: _Optional[_Union[StateScopeRef, _Mapping]] = ..., key: _Optional[str] = ...) -> None: ...

class GetStateResponse(_message.Message):
    __slots__ = ("found", "value_json")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    VALUE_JSON_FIELD_NUMBER: _ClassVar[int]
    found: bool
    value_json: str
    def __init__(self, found: _Optional[bool] = ..., value_json: _Optional[str] = ...) -> None: ...

class SetStateRequest(_message.Message):
    __slots__ = ("scope", "key", "value_json", "ttl_seconds")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_JSON_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    scope: StateScopeRef
    key: str
    value_json: str
    ttl_seconds: float
    def __init__(self, scope: _Optional[_Union[StateScopeRef, _Mapping]] = ..., key: _Optional[str] = ..., value_json: _Optional[str] = ..., ttl_seconds: _Optional[float] = ...) -> None: ...

class SetStateResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DeleteStateRequest(_message.Message):
    __slots__ = ("scope", "key")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    scope: StateScopeRef
    key: str
    def __init__(self, scope: _Optional[_Union[StateScopeRef, _Mapping]] = ..., key: _Optional[str] = ...) -> None: ...

class DeleteStateResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: bool
    def __init__(self, deleted: _Optional[bool] = ...) -> None: ...

class ListStateRequest(_message.Message):
    __slots__ = ("scope", "prefix", "page_size", "after_key", "with_values")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    AFTER_KEY_FIELD_NUMBER: _ClassVar[int]
    WITH_VALUES_FIELD_NUMBER: _ClassVar[int]
    scope: StateScopeRef
    prefix: str
    page_size: int
    after_key: str
    with_values: bool
    def __init__(self, scope: _Optional[_Union[StateScopeRef, _Mapping]] = ..., prefix: _Optional[str] = ..., page_size: _Optional[int] = ..., after_key: _Optional[str] = ..., with_values: _Optional[bool] = ...) -> None: ...

class StateEntry(_message.Message):
    __slots__ = ("key", "value_json")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_JSON_FIELD_NUMBER: _ClassVar[int]
    key: str
    value_json: str
    def __init__(self, key: _Optional[str] = ..., value_json: _Optional[str] = ...) -> None: ...

class ListStateResponse(_message.Message):
    __slots__ = ("entries", "next_after_key")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    NEXT_AFTER_KEY_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[StateEntry]
    next_after_key: str
    def __init__(self, entries: _Optional[_Iterable[_Union[StateEntry, _Mapping]]] = ..., next_after_key: _Optional[str] = ...) -> None: ...
