"""Bounds on what one event of a run may carry, so that every event fits the send limit.

gRPC refuses to send a message over ``max_send_message_bytes``, and a refused Result would
end the stream with RESOURCE_EXHAUSTED: the client would never learn how the run ended.
So nothing a tool controls may make one event larger than the limit:

- **Text fields of events** (step title, summary, kind, delta channel, heartbeat and notice
  messages, the Result's error message) are cut to :attr:`EventSizes.label_chars`
  characters, ending with ``…``.
- **A step's detail** larger than :attr:`EventSizes.detail_bytes` is replaced by a short
  note saying so.
- **A DELTA** larger than :attr:`EventSizes.delta_bytes` is split into several DELTAs of
  the same step and channel: nothing is lost, the pieces arrive in order.
- **The Result** is fitted by :func:`stargrpc.runs.result_fit.fit_result` (see there): inline
  files that do not fit together travel as FileChunks, an over-large structured output or
  output text moves into a sent file (the output keeps its beginning and a marker),
  write-back items that cannot fit are dropped. Each cut or drop is announced by a Notice
  (``OUTPUT_TRUNCATED``, ``RESULT_TOO_LARGE``) just before the Result.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf import struct_pb2
from google.protobuf.message import Message

from stargrpc.text import as_text, is_text
from stargrpc.v1 import events_pb2

#: Room left in a message for what surrounds the Result or an event (response and RunEvent
#: tags, run id, seq, time, critic time left).
ENVELOPE_BYTES = 1024

#: A DELTA's text is split into pieces of at most this many UTF-8 bytes.
MAX_DELTA_BYTES = 1024 * 1024

#: Longest title, summary, kind, channel, heartbeat or notice message, error message.
MAX_LABEL_CHARS = 4096

#: Largest serialised step detail kept.
MAX_DETAIL_BYTES = 64 * 1024

#: Notice codes of a Result that was fitted to the send limit.
OUTPUT_TRUNCATED = "OUTPUT_TRUNCATED"
RESULT_TOO_LARGE = "RESULT_TOO_LARGE"
_CUT_CODES = frozenset({OUTPUT_TRUNCATED, RESULT_TOO_LARGE})


def cut_notice(event: events_pb2.RunEvent) -> str | None:
    """``"CODE: message"`` when ``event`` announces a cut (:data:`OUTPUT_TRUNCATED`,
    :data:`RESULT_TOO_LARGE`): the client got less than the tool gave. Else None."""
    if event.WhichOneof("kind") != "notice" or event.notice.code not in _CUT_CODES:
        return None
    return f"{event.notice.code}: {event.notice.message}"


def cuts_before_result(events: Sequence[events_pb2.RunEvent]) -> list[str]:
    """The cuts announced by the notices right before the Result that ends ``events`` (a
    run announces them there, in the batch that carries its Result), in order."""
    cuts = []
    index = len(events) - 2
    while index >= 0 and events[index].WhichOneof("kind") == "notice":
        cut = cut_notice(events[index])
        if cut is not None:
            cuts.append(cut)
        index -= 1
    cuts.reverse()
    return cuts


def trailing_notices(before: Sequence[events_pb2.RunEvent],
                     batch: Sequence[events_pb2.RunEvent]) -> list[events_pb2.RunEvent]:
    """The notices that end the events streamed so far, once ``batch`` is streamed after
    those that ended the batches before it (``before``): what :func:`cuts_before_result`
    must see with the next batch when that one starts with the Result."""
    start = len(batch)
    while start > 0 and batch[start - 1].WhichOneof("kind") == "notice":
        start -= 1
    return [*before, *batch] if start == 0 else list(batch[start:])

#: The sent files an over-large output or structured output moves into.
OUTPUT_FILE_NAME = "output.txt"
STRUCTURED_FILE_NAME = "structured_output.json"


@dataclass(frozen=True)
class EventSizes:
    """The bounds that follow from one send limit.

    Attributes:
        result_bytes: Largest serialised Result.
        delta_bytes: Largest DELTA text, in UTF-8 bytes.
        label_chars: Longest short text field.
        detail_bytes: Largest serialised step detail.
    """

    result_bytes: int
    delta_bytes: int
    label_chars: int
    detail_bytes: int

    @classmethod
    def for_send_limit(cls, max_send_bytes: int) -> EventSizes:
        """The bounds for a transport that sends at most ``max_send_bytes`` per message."""
        budget = max_send_bytes - min(ENVELOPE_BYTES, max_send_bytes // 4)
        return cls(result_bytes=budget,
                   delta_bytes=max(1, min(MAX_DELTA_BYTES, budget // 2)),
                   label_chars=max(16, min(MAX_LABEL_CHARS, budget // 64)),
                   detail_bytes=max(64, min(MAX_DETAIL_BYTES, budget // 8)))


def cut_text(text: str, limit: int) -> str:
    """``text`` (:func:`~stargrpc.text.as_text`) cut to ``limit`` characters, the last one
    ``…`` when it was cut."""
    text = as_text(text)
    if len(text) <= limit:
        return text
    return text[:limit - 1] + "…"


def finite(value: Any) -> Any:
    """``value`` with every NaN and infinity written as proto3 JSON writes a double's
    (``"NaN"``, ``"Infinity"``, ``"-Infinity"``): a protobuf Value takes them as numbers but
    no JSON form of it can be written, so a Result holding one broke every reader (the
    audit record, the gateway, the clients). Nesting too deep for protobuf is left as it
    is (refused where it is set)."""
    try:
        return _finite(value)
    except RecursionError:
        return value


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, Mapping):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def size_with(message: Message, struct: struct_pb2.Struct, value: Mapping[str, Any]
              ) -> int | None:
    """The size of ``message`` once ``struct`` (a field of it) is filled from ``value``, or
    None when ``value`` cannot be a Struct (nested beyond what protobuf takes, say)."""
    try:
        struct.update(finite(value))
    except Exception:
        return None
    return message.ByteSize()


def utf8_head(data: bytes, limit: int) -> str:
    """The longest whole-character beginning of UTF-8 ``data`` within ``limit`` bytes."""
    return data[:max(0, limit)].decode("utf-8", errors="ignore")


def split_utf8(text: str, limit: int) -> list[str]:
    """``text`` in pieces of at most ``limit`` UTF-8 bytes, never splitting a character; a
    lone surrogate is written as its escape (:func:`~stargrpc.text.as_text`)."""
    if len(text) * 4 <= limit and is_text(text):  # no character takes more than 4 bytes
        return [text]
    # Encoded once, escaping as it goes (as_text would encode it a first time).
    data = text.encode(errors="backslashreplace")
    if len(data) <= limit:
        return [data.decode()]
    pieces = []
    start = 0
    while start < len(data):
        end = min(start + limit, len(data))
        # Back off to a character boundary: continuation bytes are 0b10xxxxxx.
        while end < len(data) and end > start and data[end] & 0xC0 == 0x80:
            end -= 1
        pieces.append(data[start:end].decode())
        start = end
    return pieces
