"""Decoding and validating tool arguments.

Arguments arrive as a ``google.protobuf.Struct`` (convenient from grpcurl and JSON clients;
every number is a double) or as raw JSON text (exact numbers, big integers). They are
validated against the tool's pydantic model in lax mode, so ``"3"`` and ``3.0`` become ``3``
and ``"true"`` becomes ``True``, and rejected precisely: each bad field is named.

Unknown fields are rejected unless the model says otherwise (``extra="ignore"`` or
``"allow"``): a misspelt optional argument silently ignored is a bug the caller never sees.

NaN and ±Infinity are refused wherever they come from (a Struct double, ``NaN`` in raw JSON,
a float in a dict handed to the test harness): JSON cannot carry them, so neither the audit
record nor a tool's own JSON output could. Each is named by its path, e.g.
``arguments.x.y[2]``.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from google.protobuf import struct_pb2
from pydantic import BaseModel, ValidationError

from stargrpc.errors import FieldViolation, InvalidArgument


@dataclass(frozen=True)
class ArgumentLimits:
    """Bounds on the arguments of one call."""

    max_bytes: int = 1024 * 1024
    max_depth: int = 64


#: NaN and Infinity are parsed so that validate() can name where they are.
_DECODER = json.JSONDecoder(parse_constant=float)
#: What tells whether a decoded value has a UTF-8 form (_has_utf8_form).
_ENCODER = json.JSONEncoder(ensure_ascii=False)


def decode_struct(struct: struct_pb2.Struct, limits: ArgumentLimits) -> dict[str, Any]:
    """A Struct as a plain dict, after the size and depth checks.

    A non-finite double is kept as a float here; :func:`validate` names it.
    """
    size = struct.ByteSize()
    if size > limits.max_bytes:
        raise _too_large("arguments", size, limits)
    return _struct_to_dict(struct, limits.max_depth)


def decode_json(text: str, limits: ArgumentLimits) -> dict[str, Any]:
    """Raw JSON text as a dict, with integers kept exact."""
    if text == "{}":  # most calls of a tool without arguments
        return {}
    size = len(text.encode())
    if size > limits.max_bytes:
        raise _too_large("arguments_json", size, limits)
    try:
        # The decoder made once (json.loads with an option makes one per call); a leading
        # BOM still gets json.loads's own refusal.
        value = (_DECODER.decode(text) if not text.startswith("\ufeff")
                 else json.loads(text, parse_constant=float))
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
    if _SURROGATE_ESCAPE.search(text) and not _has_utf8_form(value):
        raise InvalidArgument(
            "arguments_json holds a lone surrogate",
            [FieldViolation("arguments_json", "an escape such as \\ud800 that is not half "
                            "of a pair stands for no Unicode character")])
    return value


#: A JSON escape of a UTF-16 surrogate (a pair is one character; one alone is none).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _has_utf8_form(value: Any) -> bool:
    """Whether every string of the decoded JSON ``value`` (keys too) is Unicode text."""
    try:
        _ENCODER.encode(value).encode()
    except UnicodeEncodeError:
        return False
    return True


def validate(model: type[BaseModel], raw: dict[str, Any], *, field_prefix: str = "arguments"
             ) -> BaseModel:
    """Validates ``raw`` against ``model``; every bad field becomes one violation.

    Raises:
        InvalidArgument: With a ``google.rpc.BadRequest`` listing each bad field.
    """
    # Paths are spelt out only when a number is not finite: most arguments have none.
    violations = (_non_finite_numbers(raw, field_prefix)
                  if raw and _has_non_finite(raw) else [])
    if raw:
        known = _known_names(model)
        if known is not None:
            for key in raw:
                if key not in known:
                    violations.append(FieldViolation(f"{field_prefix}.{key}",
                                                     "unknown field"))
    try:
        value = model.model_validate(raw)
    except ValidationError as exc:
        named = {v.field for v in violations}
        for error in exc.errors(include_url=False):
            field = field_path(field_prefix, error["loc"])
            if field not in named:  # a non-finite number is named once, for what it is
                violations.append(FieldViolation(field, error["msg"]))
        value = None
    except (SystemExit, KeyboardInterrupt, GeneratorExit) as exc:
        # The model's own validators are the tool's code: out of the call's task these
        # would stop the event loop, and the server with it. A failure like any other.
        raise RuntimeError(f"the argument model {model.__name__} raised "
                           f"{type(exc).__name__}") from exc
    if violations:
        names = ", ".join(v.field for v in violations[:5])
        raise InvalidArgument(f"invalid arguments: {names}", violations)
    assert value is not None
    return value


@functools.lru_cache(maxsize=1024)  # per tool model: its fields are fixed once it is made
def _known_names(model: type[BaseModel]) -> frozenset[str] | None:
    """The argument names ``model`` takes (fields and their aliases), or None when it
    takes unknown names too (``extra`` set)."""
    if model.model_config.get("extra") is not None:
        return None
    known = set()
    for name, info in model.model_fields.items():
        known.add(name)
        if info.alias:
            known.add(info.alias)
    return frozenset(known)


def _has_non_finite(node: Any) -> bool:
    """Whether a NaN or ±Infinity is anywhere in ``node`` (:func:`_non_finite_numbers`
    without making a path for every value on the way)."""
    stack = [node]
    while stack:
        node = stack.pop()
        kind = type(node)
        if kind is str or kind is int or kind is bool or node is None:
            continue
        if isinstance(node, float):
            if not math.isfinite(node):
                return True
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list | tuple):
            stack.extend(node)
    return False


def field_path(prefix: str, parts: Iterable[str | int]) -> str:
    """A field's path as violations name it: ``arguments.x.y[2]``."""
    path = prefix
    for part in parts:
        path = f"{path}[{part}]" if isinstance(part, int) else f"{path}.{part}"
    return path


def _non_finite_numbers(raw: dict[str, Any], field_prefix: str) -> list[FieldViolation]:
    """A violation for each NaN or ±Infinity anywhere in ``raw``, named by its path."""
    found: list[FieldViolation] = []
    stack: list[tuple[Any, str]] = [(raw, field_prefix)]
    while stack:  # iterative: depth was bounded by the decoder, but not for every caller
        node, path = stack.pop()
        if isinstance(node, float):
            if not math.isfinite(node):
                found.append(FieldViolation(path, f"{node} is not a finite number; JSON "
                                                  "carries only finite numbers"))
        elif isinstance(node, dict):
            stack.extend((v, field_path(path, (k,))) for k, v in reversed(node.items()))
        elif isinstance(node, list | tuple):
            stack.extend((v, field_path(path, (i,))) for i, v in reversed(list(enumerate(node))))
    return found


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


def _struct_to_dict(struct: struct_pb2.Struct, limit: int) -> dict[str, Any]:
    """The Struct as plain Python values (numbers as floats, as ``MessageToDict`` gives
    them), with its depth checked on the way. Iterative, so a hostile nesting cannot
    exhaust the interpreter stack."""
    root: dict[str, Any] = {}
    # (message, where its items go, the depth of its items); the top level is depth 1.
    stack: list[tuple[Any, Any, int]] = [(struct, root, 2)]
    while stack:
        node, into, depth = stack.pop()
        if isinstance(node, struct_pb2.Struct):
            items: Any = node.fields.items()
        else:
            items = enumerate(node.values)
        for key, value in items:
            if depth > limit:
                raise _too_deep("arguments", limit)
            kind = value.WhichOneof("kind")
            item: Any
            if kind == "struct_value":
                item = {}
                stack.append((value.struct_value, item, depth + 1))
            elif kind == "list_value":
                item = [None] * len(value.list_value.values)
                stack.append((value.list_value, item, depth + 1))
            elif kind == "null_value" or kind is None:
                item = None
            else:
                item = getattr(value, kind)
            into[key] = item
    return root


def _check_depth_json(value: Any, limit: int, field: str) -> None:
    if nests_deeper(value, limit):
        raise _too_deep(field, limit)


def nests_deeper(value: Any, limit: int) -> bool:
    """Whether ``value`` (parsed JSON: dicts, lists, scalars) nests deeper than ``limit``
    levels, a scalar being one level deep and ``[1]`` two; walked without recursion."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend((v, depth + 1) for v in node)
    return False
