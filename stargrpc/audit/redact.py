"""Redaction and truncation of what an audit record shows.

Keys: any mapping key that names a secret, at any depth, has its value replaced by
:data:`REDACTED`. A key is split into words (``dbPassword`` → db password, ``X-Api-Key`` →
x api key, ``private_key`` → private key) and case-folded, and the words are matched, not
substrings: ``pin``, ``jwt`` and ``token`` are secrets, ``pinned``, ``spinner``,
``keyboard``, ``author`` and ``tokenizer`` are not.

Text: string values, the result text and the detail are scrubbed of secrets written
inside them (:func:`scrub_text`): the password of a URL or DSN
(``postgresql://user:pw@host``, ``redis://:pw@host``), query parameters and ``name=value``
or ``name: value`` pairs whose name is a secret (``?token=…&api_key=…``,
``host=x password=y``, ``"apiKey": "…"``), and the credentials after ``Bearer`` or
``Authorization:``.

Long strings and long lists are cut, saying how much was cut, and the JSON text as a whole
is capped.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: What a secret value becomes.
REDACTED = "<redacted>"

# Words that name a secret on their own. Plurals are listed where the plural names secrets
# too ("secrets"); not "tokens", which counts things ("max_tokens").
_SECRET_WORDS = frozenset({
    "password", "passwd", "pwd", "pass", "passphrase", "passcode", "pin", "secret",
    "secrets", "token", "jwt", "credential", "credentials", "cred", "creds", "cookie",
    "cookies", "auth", "authorization", "bearer", "signature", "session", "sessionid",
    "otp", "totp", "dsn",
})

# Two words that name a secret together ("api key"), and so glued into one ("apikey").
_KEY_WORDS = ("key", "keys")
_KEY_KINDS = ("api", "private", "access", "secret", "signing", "encryption", "master",
              "ssh", "session", "client", "auth")
_SECRET_PAIRS = frozenset((kind, key) for kind in _KEY_KINDS for key in _KEY_WORDS)
_GLUED = frozenset(kind + key for kind, key in _SECRET_PAIRS) | frozenset({
    "accesstoken", "authtoken", "refreshtoken", "idtoken", "apitoken", "clientsecret",
    "appsecret", "sessiontoken", "xsrftoken", "csrftoken",
})

# Fragments that mean a secret even inside a longer word ("dbpassword", "sshpassphrase").
_SECRET_STEMS = ("passw", "passphrase", "passcode", "credential")

_WORD_PARTS = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")


def key_words(key: str) -> list[str]:
    """The words of a key, case-folded: ``"dbPassword"`` → ``["db", "password"]``,
    ``"X-Api-Key"`` → ``["x", "api", "key"]``, ``"HTTPAuthToken"`` →
    ``["http", "auth", "token"]``."""
    return [part.casefold() for part in _WORD_PARTS.findall(key)]


@functools.lru_cache(maxsize=4096)
def is_secret_key(key: object) -> bool:
    """Whether a mapping key (or a parameter name) names something that must not be kept."""
    words = key_words(str(key))
    for index, word in enumerate(words):
        if word in _SECRET_WORDS or word in _GLUED \
                or any(stem in word for stem in _SECRET_STEMS):
            return True
        if index and (words[index - 1], word) in _SECRET_PAIRS:
            return True
    return False


# Secrets written inside text. Each alternative captures what is kept in ``keep`` and
# redacts the rest of the match.
_SECRET_IN_TEXT = re.compile(
    # scheme://user:password@host (the user may be empty: redis://:pw@host)
    r"(?P<url>[A-Za-z][A-Za-z0-9+.\-]*://[^\s:/?#@\"']*:)[^\s/?#@\"']*(?=@)"
    # Authorization: <scheme> <credentials> / Bearer <token>
    r"|(?P<header>\bauthorization\b[\"']?\s*[:=]\s*[\"']?(?:[A-Za-z]+\s+)?|\bbearer\s+)"
    r"[A-Za-z0-9\-._~+/]+=*"
    # name=value, name: value, "name": "value", ?name=value&… (the name decides)
    r"|(?P<pair>(?P<name>[A-Za-z_][A-Za-z0-9_.\-]*)[\"']?\s*(?::(?!//)|=)\s*)"
    r"(?P<value>\"[^\"]*\"|'[^']*'|[^\s&;,\"'}]+)",
    re.IGNORECASE,
)


def scrub_text(text: str) -> str:
    """``text`` with the secrets written inside it redacted (see the module docstring)."""
    # Nearly every value has neither separator: skip the expression for those.
    if ":" not in text and "=" not in text and "earer" not in text and "EARER" not in text:
        return text
    shown: list[str] = []
    position = 0
    while (match := _SECRET_IN_TEXT.search(text, position)) is not None:
        kept = match.group("url") or match.group("header")
        if kept is None and not is_secret_key(match.group("name")):
            # Not a secret: go on right after its separator, so that a value such as a URL
            # is scanned too ("url=https://h/x?token=…").
            shown.append(text[position:match.end("pair")])
            position = match.end("pair")
            continue
        if kept is None:
            value = match.group("value")
            quote = value[0] if value[0] in "\"'" else ""
            kept = f"{match.group('pair')}{quote}{REDACTED}{quote}"
        else:
            kept += REDACTED
        shown.append(text[position:match.start()] + kept)
        position = match.end()
    shown.append(text[position:])
    return "".join(shown)


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


def scrub_and_cut(text: str, limit: int) -> str:
    """``text`` scrubbed of secrets (:func:`scrub_text`), then cut to ``limit``.

    Scrubbed before it is cut, so that a secret the cut would split is still found whole;
    of a long text only what the cut keeps and a margin after it are scanned.
    """
    if not text:
        return text
    if len(text) > limit + _SCAN_MARGIN:
        return f"{scrub_text(text[:limit + _SCAN_MARGIN])[:limit]}…[+{len(text) - limit} chars]"
    return cut(scrub_text(text), limit)


#: Characters scanned past the cut, for a secret that starts before it and runs over it.
_SCAN_MARGIN = 4096


def redact(value: Any, limits: RedactionLimits | None = None) -> Any:
    """A copy of ``value`` with secret-looking keys redacted at any depth, secrets inside
    strings scrubbed, and long values truncated. Values that are not JSON types are shown
    as their ``str()``."""
    return _redact(value, limits or RedactionLimits(), 0)


#: Tuples, not ``bool | int | float``: a union written in the test is made anew on every
#: call, and this runs for every value of every call's arguments.
_SCALARS = (bool, int, float)
_SEQUENCES = (list, tuple)


def _redact(value: Any, limits: RedactionLimits, depth: int) -> Any:
    if isinstance(value, str):
        return scrub_and_cut(value, limits.max_value_chars)
    if value is None or isinstance(value, _SCALARS):
        return value
    if depth >= limits.max_depth:
        return f"…[nested deeper than {limits.max_depth} levels]"
    if type(value) is dict or isinstance(value, Mapping):  # (the first test: cheaper)
        shown: dict[str, Any] = {}
        for index, (key, item) in enumerate(value.items()):
            if index == limits.max_items:
                shown["…"] = f"[+{len(value) - limits.max_items} keys]"
                break
            name = str(key)
            shown[name] = REDACTED if is_secret_key(name) else _redact(item, limits, depth + 1)
        return shown
    if isinstance(value, _SEQUENCES):
        items = [_redact(item, limits, depth + 1) for item in value[:limits.max_items]]
        if len(value) > limits.max_items:
            items.append(f"…[+{len(value) - limits.max_items} items]")
        return items
    return scrub_and_cut(str(value), limits.max_value_chars)


def redacted_json(value: Any, limits: RedactionLimits | None = None) -> str:
    """``value`` redacted (:func:`redact`) as compact JSON text, capped in length."""
    if type(value) is dict and not value:  # a call without arguments
        return "{}"
    limits = limits or RedactionLimits()
    return cut(_compact(redact(value, limits)), limits.max_total_chars)


#: What json.dumps(..., ensure_ascii=False, separators=(",", ":"), default=str) writes,
#: with the encoder made once rather than for every call's audit record.
_COMPACT = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), default=str)

#: The C encoder behind :data:`_COMPACT`, made once: ``JSONEncoder.encode`` makes one on
#: every call (and goes through two Python frames to get there). Without a circular-
#: reference check, which nothing :func:`redact` returns needs: its value is a fresh tree
#: cut at ``max_depth``. None where the json module has no C accelerator.
_MAKE_ENCODER: Any = getattr(json.encoder, "c_make_encoder", None)  # (not in the stubs)
_C_COMPACT = (_MAKE_ENCODER(None, str, json.encoder.encode_basestring, None, ":", ",",
                            False, False, True)
              if _MAKE_ENCODER is not None else None)


def _compact(value: Any) -> str:
    """``_COMPACT.encode(value)`` for a value :func:`redact` returned."""
    if _C_COMPACT is None:
        return _COMPACT.encode(value)
    return "".join(_C_COMPACT(value, 0))
