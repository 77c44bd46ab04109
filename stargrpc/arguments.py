"""Decoding and validating tool arguments.

Arguments arrive as a ``google.protobuf.Struct`` (convenient from grpcurl and JSON clients;
every number is a double) or as raw JSON text (exact numbers, big integers). They are
validated against the tool's pydantic model in lax mode, so ``"3"`` and ``3.0`` become ``3``
and ``"true"`` becomes ``True``, and rejected precisely: each bad field is named.

Unknown fields are rejected unless the model says otherwise (``extra="ignore"`` or
``"allow"``): a misspelt optional argument silently ignored is a bug the caller never sees.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format, struct_pb2
from pydantic import BaseModel, ValidationError

from stargrpc.errors import FieldViolation, InvalidArgument


@dataclass(frozen=True)
class ArgumentLimits:
    """Bounds on the arguments of one call."""

    max_bytes: int = 1024 * 1024
    max_depth: int = 64


def decode_struct(struct: struct_pb2.Struct, limits: ArgumentLimits) -> dict[str, Any]:
    """A Struct as a plain dict, after the size and depth checks."""
    size = struct.ByteSize()
    if size > limits.max_bytes:
        raise _too_large("arguments", size, limits)
    _check_depth_struct(struct, limits.max_depth)
    return json_format.MessageToDict(struct)


def decode_json(text: str, limits: ArgumentLimits) -> dict[str, Any]:
    """Raw JSON text as a dict, with integers kept exact."""
    size = len(text.encode())
    if size > limits.max_bytes:
        raise _too_large("arguments_json", size, limits)
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise InvalidArgument(
            "arguments_json is nested too deeply",
            [FieldViolation("arguments_json", f"nested deeper than {limits.max_depth} levels")],
        ) from None
    except ValueError as exc:
        raise InvalidArgument(
            "arguments_json is not valid JSON",
            [FieldViolation("arguments_json", f"invalid JSON: {exc}")],
        ) from None
    if not isinstance(value, dict):
        raise InvalidArgument(
            "arguments must be a JSON object",
            [FieldViolation("arguments_json",
                            f"expected a JSON object, got {type(value).__name__}")],
        )
    _check_depth_json(value, limits.max_depth, "arguments_json")
    return value


def validate(model: type[BaseModel], raw: dict[str, Any], *, field_prefix: str = "arguments"
             ) -> BaseModel:
    """Validates ``raw`` against ``model``; every bad field becomes one violation.

    Raises:
        InvalidArgument: With a ``google.rpc.BadRequest`` listing each bad field.
    """
    violations: list[FieldViolation] = []
    if model.model_config.get("extra") is None:
        known = set()
        for name, info in model.model_fields.items():
            known.add(name)
            if info.alias:
                known.add(info.alias)
        for key in raw:
            if key not in known:
                violations.append(FieldViolation(f"{field_prefix}.{key}", "unknown field"))
    try:
        value = model.model_validate(raw)
    except ValidationError as exc:
        for error in exc.errors(include_url=False):
            path = ".".join(str(part) for part in error["loc"])
            field = f"{field_prefix}.{path}" if path else field_prefix
            violations.append(FieldViolation(field, error["msg"]))
        value = None
    if violations:
        names = ", ".join(v.field for v in violations[:5])
        raise InvalidArgument(f"invalid arguments: {names}", violations)
    assert value is not None
    return value


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _too_large(field: str, size: int, limits: ArgumentLimits) -> InvalidArgument:
    return InvalidArgument(
        f"{field} is {size} bytes; the limit is {limits.max_bytes}",
        [FieldViolation(field, f"{size} bytes exceeds the limit of {limits.max_bytes} bytes")],
    )


def _too_deep(field: str, limit: int) -> InvalidArgument:
    return InvalidArgument(
        f"{field} is nested too deeply",
        [FieldViolation(field, f"nested deeper than {limit} levels")],
    )


def _check_depth_struct(struct: struct_pb2.Struct, limit: int) -> None:
    # Iterative, so a hostile nesting cannot exhaust the interpreter stack.
    stack: list[tuple[Any, int]] = [(struct, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            raise _too_deep("arguments", limit)
        if isinstance(node, struct_pb2.Struct):
            stack.extend((v, depth + 1) for v in node.fields.values())
        elif isinstance(node, struct_pb2.ListValue):
            stack.extend((v, depth + 1) for v in node.values)
        else:
            kind = node.WhichOneof("kind")
            if kind == "struct_value":
                stack.append((node.struct_value, depth))
            elif kind == "list_value":
                stack.append((node.list_value, depth))


def _check_depth_json(value: Any, limit: int, field: str) -> None:
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            raise _too_deep(field, limit)
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
