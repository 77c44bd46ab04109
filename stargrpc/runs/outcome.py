"""Outcome classification: what a tool's return value or exception means.

A clean return is not proof of success. A tool reports failure by raising
:class:`~stargrpc.errors.ToolFailed` / :class:`~stargrpc.errors.ToolDenied`, by returning a
:class:`ToolResult` with an outcome, or — for tools written against older conventions — by
returning a dict such as ``{"success": False, "error": "permission denied"}``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from stargrpc.contract import Outcome
from stargrpc.errors import ToolOutcomeError


@dataclass(frozen=True)
class ToolResult:
    """What a tool may return to state its outcome explicitly.

    Attributes:
        output: Text for the model.
        outcome: How the run ended.
        structured: JSON-ready structured output.
        error_message: A user-safe reason, for outcomes other than OK.
        error_code: A stable machine-readable code for the error.
    """

    output: str = ""
    outcome: Outcome = Outcome.OK
    structured: Any = None
    error_message: str = ""
    error_code: str = ""


#: What a tool that returns None or "" produced.
_EMPTY = ToolResult()

# Phrases that mark an error as the caller being refused rather than the tool failing.
_DENIAL = re.compile(
    r"permission denied|access denied|not authori[sz]ed|unauthori[sz]ed|forbidden|"
    r"not permitted|not allowed|does not have the .{0,80}privilege|insufficient privilege",
    re.IGNORECASE,
)


def is_denial(message: str) -> bool:
    """Whether an error message says the caller was refused."""
    return bool(_DENIAL.search(message))


def classify_return(value: Any) -> ToolResult:
    """Turns whatever a tool returned into a :class:`ToolResult`."""
    if isinstance(value, ToolResult):
        return value
    if value is None:
        return _EMPTY  # shared: a ToolResult cannot be changed
    if isinstance(value, str):
        return ToolResult(output=value) if value else _EMPTY
    if isinstance(value, BaseModel):
        data = value.model_dump(mode="json")
        return ToolResult(output=_json_text(data), structured=data)
    if isinstance(value, Mapping):
        return _classify_mapping(value)
    if isinstance(value, bytes | bytearray):
        return ToolResult(output=bytes(value).decode("utf-8", errors="replace"))
    return ToolResult(output=_json_text(value), structured=_jsonable(value))


def classify_exception(exc: ToolOutcomeError) -> ToolResult:
    """The result of a tool that raised ToolFailed or ToolDenied."""
    outcome = Outcome[exc.outcome_name]
    return ToolResult(outcome=outcome, error_message=exc.message, error_code=exc.code)


def _classify_mapping(value: Mapping[Any, Any]) -> ToolResult:
    data = _jsonable(dict(value))
    failed = value.get("success") is False or value.get("ok") is False
    if not failed:
        return ToolResult(output=_json_text(data), structured=data)
    error = value.get("error") or value.get("message") or "the tool reported a failure"
    message = error if isinstance(error, str) else _json_text(_jsonable(error))
    outcome = Outcome.DENIED if is_denial(message) else Outcome.FAILED
    return ToolResult(output=message, outcome=outcome, structured=data, error_message=message,
                      error_code=f"TOOL_{outcome.name}")


def _jsonable(value: Any) -> Any:
    return json.loads(_json_text(value))


def _json_text(value: Any) -> str:
    return _ENCODER.encode(value)


#: json.dumps(value, ensure_ascii=False, default=str), the encoder made once.
_ENCODER = json.JSONEncoder(ensure_ascii=False, default=str)
