from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tool(_message.Message):
    __slots__ = ("name", "description", "input_schema", "output_schema", "kind", "categories", "annotations", "permissions", "requires_approval", "lane", "default_priority")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    INPUT_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    CATEGORIES_FIELD_NUMBER: _ClassVar[int]
    ANNOTATIONS_FIELD_NUMBER: _ClassVar[int]
    PERMISSIONS_FIELD_NUMBER: _ClassVar[int]
    REQUIRES_APPROVAL_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    input_schema: _struct_pb2.Struct
    output_schema: _struct_pb2.Struct
    kind: str
    categories: _containers.RepeatedScalarFieldContainer[str]
    annotations: ToolAnnotations
    permissions: ToolPermissions
    requires_approval: bool
    lane: str
    default_priority: int
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., input_schema: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., output_schema: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., kind: _Optional[str] = ..., categories: _Optional[_Iterable[str]] = ..., annotations: _Optional[_Union[ToolAnnotations, _Mapping]] = ..., permissions: _Optional[_Union[ToolPermissions, _Mapping]] = ..., requires_approval: _Optional[bool] = ..., lane: _Optional[str] = ..., default_priority: _Optional[int] = ...) -> None: ...

class ToolAnnotations(_message.Message):
    __slots__ = ("read_only", "destructive", "idempotent", "open_world")
    READ_ONLY_FIELD_NUMBER: _ClassVar[int]
    DESTRUCTIVE_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENT_FIELD_NUMBER: _ClassVar[int]
    OPEN_WORLD_FIELD_NUMBER: _ClassVar[int]
    read_only: bool
    destructive: bool
    idempotent: bool
    open_world: bool
    def __init__(self, read_only: _Optional[bool] = ..., destructive: _Optional[bool] = ..., idempotent: _Optional[bool] = ..., open_world: _Optional[bool] = ...) -> None: ...

class ToolPermissions(_message.Message):
    __slots__ = ("privileged", "allowed_roles", "allowed_principals", "callable")
    PRIVILEGED_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_ROLES_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_PRINCIPALS_FIELD_NUMBER: _ClassVar[int]
    CALLABLE_FIELD_NUMBER: _ClassVar[int]
    privileged: bool
    allowed_roles: _containers.RepeatedScalarFieldContainer[str]
    allowed_principals: _containers.RepeatedScalarFieldContainer[str]
    callable: bool
    def __init__(self, privileged: _Optional[bool] = ..., allowed_roles: _Optional[_Iterable[str]] = ..., allowed_principals: _Optional[_Iterable[str]] = ..., callable: _Optional[bool] = ...) -> None: ...
