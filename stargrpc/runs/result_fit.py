"""Fitting a run's Result into the size limits of one event (:mod:`stargrpc.runs.event_sizes`).

:func:`fit_result` is a pure function of what the tool ended with (its
:class:`~stargrpc.runs.outcome.ToolResult`), the write-back it collected and the limits: it
fills the Result message and says what the run must send before it — the sent files that
travel as FileChunks, and the notices that announce each cut or drop. The run
(:mod:`stargrpc.runs.run`) only sends them, the chunks first, then the notices, then the Result.

The room of a Result (:attr:`EventSizes.result_bytes`) is shared out so that nothing a tool
controls can make it larger: a quarter goes to the inline files together (the largest move
to FileChunks until the rest fit, and any over ``inline_file_bytes`` always does), a quarter
to the write-back listing (sent files, injected tools, rich messages, in order: what does
not fit is dropped, and a dropped file is not streamed either), a quarter to the structured
output (when larger, it moves into a sent file), and the output text gets whatever is left
(when larger, its beginning stays, with a marker, and the whole text moves into a sent
file).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import duration_pb2, json_format

from stargrpc.runs.context import SentFileRecord, WriteBack
from stargrpc.runs.event_sizes import (
    OUTPUT_FILE_NAME,
    OUTPUT_TRUNCATED,
    RESULT_TOO_LARGE,
    STRUCTURED_FILE_NAME,
    EventSizes,
    cut_text,
    finite,
    size_with,
    utf8_head,
)
from stargrpc.runs.outcome import Outcome, ToolResult
from stargrpc.text import as_text
from stargrpc.v1 import events_pb2

#: Room the output text leaves for the listing of the sent file it may move into.
_MOVED_LISTING_BYTES = 2 * 1024


@dataclass
class ResultFit:
    """What a Result needs beyond its message: what the run sends before it.

    Attributes:
        files: The sent files to stream as FileChunks before the Result (listed in it as
            ``streamed``), in the order of its listing: the tool's own, then the structured
            output and the output text moved out of it. The caller takes them off as it
            streams them, so that a file's bytes go once its chunks are in the log.
        notices: ``(code, message)`` of the warning Notices that announce each cut or drop
            (codes :data:`~stargrpc.runs.event_sizes.OUTPUT_TRUNCATED`,
            :data:`~stargrpc.runs.event_sizes.RESULT_TOO_LARGE`), in order, to send right before
            the Result.
        oversize: The size of the Result the fitting still could not bring under the limit
            (which it should make impossible), 0 when it fit; the Result is then an ERROR
            saying so instead.
    """

    files: list[SentFileRecord] = field(default_factory=list)
    notices: list[tuple[str, str]] = field(default_factory=list)
    oversize: int = 0


def fit_result(result: events_pb2.Result, outcome: ToolResult, writeback: WriteBack, *,
               run_id: str, duration_ns: int, sizes: EventSizes, inline_file_bytes: int
               ) -> ResultFit | None:
    """Fills ``result`` with the Result of a run that ended with ``outcome``, fitted to
    ``sizes``.

    Reads ``outcome`` and ``writeback`` and changes neither. A Result that fits as the tool
    gave it (the common case) costs nothing beyond its message.

    Args:
        result: The Result to fill, empty but for its ``usage`` (the one inside the event
            the run appends: making it elsewhere would copy it). The usage is counted in
            the room the rest shares, and kept when the Result must become an error.
        outcome: How the tool ended.
        writeback: The files, injected tools and rich messages the tool handed back.
        run_id: The run's id, which the ids of the files the fitting makes start with.
        duration_ns: The Result's duration.
        sizes: The bounds of one event.
        inline_file_bytes: Largest sent file that may travel inside the Result.

    Returns:
        What to send before the Result, or None when there is nothing: no file to stream
        and nothing cut.
    """
    fit: ResultFit | None = None
    result.outcome = outcome.outcome.value  # type: ignore[assignment]
    if outcome.outcome is not Outcome.OK:
        error = result.error
        error.code = cut_text(outcome.error_code or outcome.outcome.name, sizes.label_chars)
        error.message = cut_text(outcome.error_message or outcome.outcome.name.lower(),
                                 sizes.label_chars)
    set_duration(result.duration, duration_ns)
    quarter = sizes.result_bytes // 4
    inline_bytes = 0
    # The tool's sent files listed in the Result, each with whether it streams (made only
    # for a tool that handed something back: most never do).
    listed: list[tuple[SentFileRecord, bool]] | None = None
    if writeback.sent_files or writeback.injected_tools or writeback.rich_messages:
        listed = []
        to_stream, inline_bytes = _choose_inline_files(writeback.sent_files, quarter,
                                                       inline_file_bytes)
        dropped = _list_writeback(result.writeback, writeback, to_stream, quarter,
                                  sizes.label_chars, listed)
        if dropped or to_stream:
            fit = ResultFit()
            fit.files.extend(record for record, streamed in listed if streamed)
            if dropped:
                fit.notices.append((RESULT_TOO_LARGE, f"{dropped} did not fit in the Result "
                                                      "and were dropped"))
    if outcome.structured is not None:
        data = _structured_over(result, outcome.structured, quarter)
        if data is not None:
            fit = fit or ResultFit()
            record = _moved_to_file(run_id, STRUCTURED_FILE_NAME, "application/json", data,
                                    result.writeback, fit)
            fit.notices.append((OUTPUT_TRUNCATED, f"the structured output ({len(data)} bytes) "
                                                  f"was too large for the Result; it is in "
                                                  f"sent file {STRUCTURED_FILE_NAME} "
                                                  f"({record.file_id})"))
    # What is left for the output: the listing of the files it may move into is small.
    room = sizes.result_bytes - result.ByteSize() - inline_bytes - _MOVED_LISTING_BYTES
    output = as_text(outcome.output)
    if len(output) * 4 > room and len(encoded := output.encode()) > room:
        fit = fit or ResultFit()
        record = _moved_to_file(run_id, OUTPUT_FILE_NAME, "text/plain; charset=utf-8",
                                encoded, result.writeback, fit)
        marker = (f"\n[output truncated: {len(encoded)} bytes in all; the whole text is "
                  f"in sent file {OUTPUT_FILE_NAME} ({record.file_id})]")
        output = utf8_head(encoded, room - len(marker.encode())) + marker
        fit.notices.append((OUTPUT_TRUNCATED, f"the output ({len(encoded)} bytes) was cut to "
                                              f"fit the Result; the whole text is in sent file "
                                              f"{OUTPUT_FILE_NAME} ({record.file_id})"))
    result.output = output
    if listed or (fit is not None and fit.files):
        # The inline files' bytes go in last: the shares above count them apart.
        inline = iter([record for record, streamed in listed or () if not streamed])
        for entry in result.writeback.sent_files:
            if not entry.streamed:
                entry.content = next(inline).data
        size = result.ByteSize()
        if size > sizes.result_bytes:
            fit = fit or ResultFit()
            fit.oversize = size
            _replace_with_error(result, size, sizes.result_bytes)
    return fit


def set_duration(message: duration_pb2.Duration, nanoseconds: int) -> None:
    """Sets ``message`` to ``nanoseconds``.

    The same value as ``Duration.FromNanoseconds(nanoseconds)``, whose pure-Python helper
    costs more than setting the two fields; it runs for every Result.
    """
    whole, nanos = divmod(nanoseconds, 1_000_000_000)
    if whole < 0 and nanos:  # a Duration's nanos take the sign of its seconds
        whole += 1
        nanos -= 1_000_000_000
    message.seconds, message.nanos = whole, nanos


def _choose_inline_files(files: list[SentFileRecord], room: int, inline_file_bytes: int
                         ) -> tuple[set[str], int]:
    """The ids of the sent files that travel as FileChunks — those over
    ``inline_file_bytes``, and the largest of the others until those left fit in ``room``
    — and the bytes of the files left inline."""
    to_stream = set()
    inline = []
    for record in files:
        if record.size > inline_file_bytes:
            to_stream.add(record.file_id)
        else:
            inline.append(record)
    total = 0
    for record in sorted(inline, key=lambda r: r.size):
        if total + record.size <= room:
            total += record.size
        else:
            to_stream.add(record.file_id)
    return to_stream, total


def _list_writeback(listing: events_pb2.WriteBack, writeback: WriteBack, to_stream: set[str],
                    room: int, label: int, listed: list[tuple[SentFileRecord, bool]]) -> str:
    """Lists the sent files (without their bytes), injected tools and rich messages of
    ``writeback`` in ``listing``, in order while they fit in ``room``; adds each file listed
    to ``listed`` with whether it streams. Says what was dropped ("" for nothing)."""
    used = 0
    dropped = {"sent files": 0, "injected tools": 0, "rich messages": 0}

    def kept(items: Any, what: str, size: int | None) -> bool:
        nonlocal used
        if size is not None and used + size <= room:
            used += size
            return True
        del items[-1]
        dropped[what] += 1
        return False

    for record in writeback.sent_files:
        streamed = record.file_id in to_stream
        entry = listing.sent_files.add(
            file_id=record.file_id, name=cut_text(record.name, label),
            mime_type=cut_text(record.mime_type, label), size=record.size,
            sha256=record.sha256, streamed=streamed)
        if kept(listing.sent_files, "sent files", entry.ByteSize()):
            listed.append((record, streamed))
    for injected in writeback.injected_tools:
        tool = listing.injected_tools.add(name=cut_text(injected.name, label),
                                          description=injected.description)
        kept(listing.injected_tools, "injected tools",
             size_with(tool, tool.input_schema, injected.input_schema))
    for message in writeback.rich_messages:
        rich = listing.sent_rich_messages.add(kind=cut_text(message.kind, label))
        kept(listing.sent_rich_messages, "rich messages",
             size_with(rich, rich.payload, message.payload))
    return ", ".join(f"{count} {what}" for what, count in dropped.items() if count)


def _structured_over(result: events_pb2.Result, structured: Any, room: int) -> bytes | None:
    """Sets the structured output; when it is larger than ``room`` (or cannot be a
    protobuf Value) clears it again and returns it as JSON, for a sent file."""
    structured = finite(structured)
    try:
        json_format.ParseDict(structured, result.structured_output)
        size = result.structured_output.ByteSize()
    except Exception:  # nested beyond what protobuf takes, say: the file still can
        size = room + 1
    if size <= room:
        return None
    result.ClearField("structured_output")
    # A lone surrogate (a file name read with surrogateescape, say) has no UTF-8 form: it
    # goes as its escape rather than failing the run's end.
    return json.dumps(structured, ensure_ascii=False, default=str).encode(
        errors="backslashreplace")


def moved_file_id(run_id: str, name: str) -> str:
    """The id of the sent file that what did not fit in run ``run_id``'s Result moved into
    (``name`` :data:`~stargrpc.runs.event_sizes.OUTPUT_FILE_NAME` or
    :data:`~stargrpc.runs.event_sizes.STRUCTURED_FILE_NAME`)."""
    return f"{run_id}-{name}"


def _moved_to_file(run_id: str, name: str, mime_type: str, data: bytes,
                   listing: events_pb2.WriteBack, fit: ResultFit) -> SentFileRecord:
    """A sent file holding what did not fit in the Result: listed in ``listing`` and
    streamed (added to ``fit.files``)."""
    record = SentFileRecord(file_id=moved_file_id(run_id, name), name=name, mime_type=mime_type,
                            data=data, sha256=hashlib.sha256(data).hexdigest())
    fit.files.append(record)
    listing.sent_files.add(file_id=record.file_id, name=name, mime_type=mime_type,
                           size=record.size, sha256=record.sha256, streamed=True)
    return record


def _replace_with_error(result: events_pb2.Result, size: int, limit: int) -> None:
    """Makes ``result`` an ERROR Result saying that it was ``size`` bytes (keeping its
    duration and usage), so that no client and no run log ever gets one over the limit."""
    duration = result.duration
    seconds, nanos = duration.seconds, duration.nanos
    usage = events_pb2.Usage()
    usage.CopyFrom(result.usage)
    had_usage = result.HasField("usage")
    result.Clear()
    if had_usage:
        result.usage.CopyFrom(usage)
    result.outcome = events_pb2.OUTCOME_ERROR
    result.error.code = RESULT_TOO_LARGE
    result.error.message = (f"the Result ({size} bytes) does not fit the largest event "
                            f"of {limit} bytes (max_event_bytes)")
    result.duration.seconds, result.duration.nanos = seconds, nanos
