"""Redaction and truncation of what an audit record shows.

Any mapping key that looks secret (password, secret, token, api key, auth, credential,
private key, cookie, session, …), at any depth, has its value replaced by
:data:`REDACTED`. Long strings and long lists are cut, saying how much was cut, and the JSON
text as a whole is capped.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: What a secret value becomes.
REDACTED = "<redacted>"

# Matched against each key. "auth"/"authorization" but not "author(s)"; "pass" alone or as
# a word part ("db_pass") but not "passenger"/"compass".
_SECRET_KEY = re.compile(
    r"passw(or)?d|passphrase|(^|[^a-z])pass($|[^a-z])|pwd|secret|token|"
    r"api[^a-z0-9]?key|auth(?!or($|[^i]))|credential|private[^a-z0-9]?key|cookie|session|"
    r"access[^a-z0-9]?key|bearer|signature",
    re.IGNORECASE,
)


def is_secret_key(key: object) -> bool:
    """Whether a mapping key names something that must not be kept."""
    return bool(_SECRET_KEY.search(str(key)))


@dataclass(frozen=True)
class RedactionLimits:
    """How much of a value the audit keeps.

    Attributes:
        max_value_chars: Longest string kept whole; longer ones are cut.
        max_items: Most items of a list or mapping kept.
        max_depth: Deepest nesting kept; deeper values are replaced by a marker.
        max_total_chars: Longest JSON text kept for the whole value.
    """

    max_value_chars: int = 1000
    max_items: int = 100
    max_depth: int = 16
    max_total_chars: int = 8000


def cut(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters plus a note of how many were cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}…[+{len(text) - limit} chars]"


def redact(value: Any, limits: RedactionLimits | None = None) -> Any:
    """A copy of ``value`` with secret-looking keys redacted at any depth and long values
    truncated. Values that are not JSON types are shown as their ``str()``."""
    return _redact(value, limits or RedactionLimits(), 0)


def _redact(value: Any, limits: RedactionLimits, depth: int) -> Any:
    if isinstance(value, str):
        return cut(value, limits.max_value_chars)
    if value is None or isinstance(value, bool | int | float):
        return value
    if depth >= limits.max_depth:
        return f"…[nested deeper than {limits.max_depth} levels]"
    if isinstance(value, Mapping):
        shown: dict[str, Any] = {}
        for index, (key, item) in enumerate(value.items()):
            if index == limits.max_items:
                shown["…"] = f"[+{len(value) - limits.max_items} keys]"
                break
            name = str(key)
            shown[name] = REDACTED if is_secret_key(name) else _redact(item, limits, depth + 1)
        return shown
    if isinstance(value, list | tuple):
        items = [_redact(item, limits, depth + 1) for item in value[:limits.max_items]]
        if len(value) > limits.max_items:
            items.append(f"…[+{len(value) - limits.max_items} items]")
        return items
    return cut(str(value), limits.max_value_chars)


def redacted_json(value: Any, limits: RedactionLimits | None = None) -> str:
    """``value`` redacted (:func:`redact`) as compact JSON text, capped in length."""
    limits = limits or RedactionLimits()
    text = json.dumps(redact(value, limits), ensure_ascii=False, separators=(",", ":"),
                      default=str)
    return cut(text, limits.max_total_chars)
