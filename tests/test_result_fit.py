"""Fitting a Result into the size of one event, on its own: no server, no run."""

from __future__ import annotations

import copy
import hashlib
import json

from stargrpc.runs.context import InjectedToolRecord, RichMessageRecord, SentFileRecord, WriteBack
from stargrpc.runs.event_sizes import (
    OUTPUT_FILE_NAME,
    OUTPUT_TRUNCATED,
    RESULT_TOO_LARGE,
    STRUCTURED_FILE_NAME,
    EventSizes,
)
from stargrpc.runs.outcome import Outcome, ToolResult
from stargrpc.runs.result_fit import ResultFit, fit_result
from stargrpc.v1 import events_pb2

#: A 16 KiB send limit: 15,360 bytes of Result, a quarter of it 3,840.
SIZES = EventSizes.for_send_limit(16 * 1024)
QUARTER = SIZES.result_bytes // 4
RUN_ID = "r1"


def _file(number: int, size: int) -> SentFileRecord:
    data = bytes([number % 256]) * size
    return SentFileRecord(file_id=f"{RUN_ID}-f{number}", name=f"f{number}.bin",
                          mime_type="application/octet-stream", data=data,
                          sha256=hashlib.sha256(data).hexdigest())


def _fit(outcome: ToolResult, writeback: WriteBack | None = None, *,
         sizes: EventSizes = SIZES, inline_file_bytes: int = 1024 * 1024
         ) -> tuple[events_pb2.Result, ResultFit | None]:
    result = events_pb2.Result()
    fit = fit_result(result, outcome, writeback or WriteBack(), run_id=RUN_ID,
                     duration_ns=1_500_000_000, sizes=sizes,
                     inline_file_bytes=inline_file_bytes)
    return result, fit


def test_a_result_that_fits_is_made_as_the_tool_gave_it_with_nothing_else_to_send() -> None:
    schema = {"type": "object"}
    writeback = WriteBack(sent_files=[_file(1, 100)],
                          injected_tools=[InjectedToolRecord("next", "Next step.", schema)],
                          rich_messages=[RichMessageRecord("card", {"title": "Done"})])
    result, fit = _fit(ToolResult(output="done", structured={"n": 1}), writeback)

    assert fit is None
    assert result.outcome == events_pb2.OUTCOME_OK
    assert result.output == "done"
    assert result.structured_output.struct_value["n"] == 1
    assert (result.duration.seconds, result.duration.nanos) == (1, 500_000_000)
    [listed] = result.writeback.sent_files
    assert (listed.file_id, listed.size, listed.streamed) == (f"{RUN_ID}-f1", 100, False)
    assert listed.content == writeback.sent_files[0].data
    assert result.writeback.injected_tools[0].name == "next"
    assert result.writeback.sent_rich_messages[0].payload["title"] == "Done"


def test_an_error_outcome_names_its_code_and_message_cut_to_a_label() -> None:
    result, fit = _fit(ToolResult(outcome=Outcome.TIMEOUT, error_message="é" * 10_000))

    assert fit is None
    assert result.outcome == events_pb2.OUTCOME_TIMEOUT
    assert result.error.code == "TIMEOUT"
    assert len(result.error.message) == SIZES.label_chars
    assert result.error.message.endswith("…")


def test_output_over_the_limit_keeps_its_beginning_and_moves_whole_into_a_file() -> None:
    output = "".join(f"line {i}\n" for i in range(5000))  # about 39 KB
    result, fit = _fit(ToolResult(output=output))

    assert fit is not None
    [moved] = fit.files
    assert (moved.file_id, moved.name) == (f"{RUN_ID}-{OUTPUT_FILE_NAME}", OUTPUT_FILE_NAME)
    assert moved.data == output.encode()
    assert moved.sha256 == hashlib.sha256(output.encode()).hexdigest()
    [listed] = result.writeback.sent_files
    assert listed.file_id == moved.file_id and listed.streamed and not listed.content
    assert result.output.startswith("line 0\nline 1\n")
    assert result.output.endswith(f"the whole text is in sent file {OUTPUT_FILE_NAME} "
                                  f"({moved.file_id})]")
    assert [code for code, _ in fit.notices] == [OUTPUT_TRUNCATED]
    assert result.ByteSize() <= SIZES.result_bytes
    assert not fit.oversize


def test_inline_files_are_chosen_by_room_and_the_rest_stream() -> None:
    # A quarter of the Result holds the inline files together: the smaller ones stay.
    files = [_file(1, 3000), _file(2, 1000), _file(3, 5000), _file(4, 2000)]
    writeback = WriteBack(sent_files=files)
    result, fit = _fit(ToolResult(output="done"), writeback, inline_file_bytes=4096)

    assert fit is not None
    # f3 is over the inline limit; f1 is the largest of those left once f2 and f4 fit.
    assert [record.file_id for record in fit.files] == [f"{RUN_ID}-f1", f"{RUN_ID}-f3"]
    assert fit.notices == []
    listed = {entry.file_id: entry for entry in result.writeback.sent_files}
    assert list(listed) == [record.file_id for record in files]  # the tool's order
    for record in files:
        entry = listed[record.file_id]
        streamed = record in fit.files
        assert entry.streamed is streamed
        assert entry.content == (b"" if streamed else record.data)
        assert (entry.size, entry.sha256) == (record.size, record.sha256)
    assert 1000 + 2000 <= QUARTER < 1000 + 2000 + 3000
    assert result.ByteSize() <= SIZES.result_bytes


def test_write_back_lists_are_cut_with_a_notice_and_a_dropped_file_is_not_streamed() -> None:
    big_schema = {"type": "object", "description": "x" * 300}
    writeback = WriteBack(
        sent_files=[_file(i, 10) for i in range(1, 5)],
        injected_tools=[InjectedToolRecord(f"tool{i}", "A tool.", big_schema)
                        for i in range(40)],
        rich_messages=[RichMessageRecord("card", {"i": i}) for i in range(3)],
    )
    result, fit = _fit(ToolResult(output="done"), writeback)

    assert fit is not None
    assert fit.files == []
    listing = result.writeback
    assert len(listing.sent_files) == 4
    kept = len(listing.injected_tools)
    assert 0 < kept < 40
    assert [tool.name for tool in listing.injected_tools] == [f"tool{i}" for i in range(kept)]
    # Each item is kept while it still fits: the small rich messages after them do.
    assert [message.payload["i"] for message in listing.sent_rich_messages] == [0, 1, 2]
    assert fit.notices == [(RESULT_TOO_LARGE, f"{40 - kept} injected tools did not fit in "
                                              "the Result and were dropped")]
    assert listing.ByteSize() <= QUARTER

    # A file that does not fit the listing is dropped, and then not streamed either.
    many = WriteBack(sent_files=[_file(i, 5000) for i in range(1, 200)])
    result, fit = _fit(ToolResult(output="done"), many)
    assert fit is not None
    listed = [entry.file_id for entry in result.writeback.sent_files]
    assert 0 < len(listed) < 199
    assert [record.file_id for record in fit.files] == listed  # all over the room: streamed
    assert fit.notices[0][1].startswith(f"{199 - len(listed)} sent files did not fit")


def test_structured_output_too_big_moves_into_a_file() -> None:
    structured = {"rows": [{"id": i, "name": "é" * 20} for i in range(200)]}
    result, fit = _fit(ToolResult(output="done", structured=structured))

    assert fit is not None
    assert not result.HasField("structured_output")
    [moved] = fit.files
    assert moved.name == STRUCTURED_FILE_NAME and moved.mime_type == "application/json"
    assert json.loads(moved.data) == structured
    assert [entry.file_id for entry in result.writeback.sent_files] == [moved.file_id]
    assert result.writeback.sent_files[0].streamed
    assert result.output == "done"
    [(code, message)] = fit.notices
    assert code == OUTPUT_TRUNCATED and STRUCTURED_FILE_NAME in message


def test_fitting_changes_neither_the_outcome_nor_the_write_back() -> None:
    files = [_file(1, 3000), _file(2, 9000)]
    tools = [InjectedToolRecord(f"t{i}", "A tool.", {"d": "x" * 300}) for i in range(40)]
    writeback = WriteBack(sent_files=list(files), injected_tools=list(tools))
    outcome = ToolResult(output="y" * 50_000, structured={"z": "w" * 8000})
    before = (copy.deepcopy(writeback), copy.deepcopy(outcome))

    _, fit = _fit(outcome, writeback, inline_file_bytes=4096)

    assert fit is not None and fit.files and fit.notices
    assert (writeback, outcome) == before
    assert writeback.sent_files == files and writeback.injected_tools == tools


def test_a_result_the_shares_cannot_bring_under_the_limit_becomes_an_error() -> None:
    # Labels larger than the whole Result: no share of the room can make up for them.
    sizes = EventSizes(result_bytes=2000, delta_bytes=1000, label_chars=4096,
                       detail_bytes=100)
    writeback = WriteBack(sent_files=[_file(1, 10)])
    outcome = ToolResult(outcome=Outcome.ERROR, error_message="m" * 4000)
    result, fit = _fit(outcome, writeback, sizes=sizes)

    assert fit is not None and fit.oversize > sizes.result_bytes
    assert result.outcome == events_pb2.OUTCOME_ERROR
    assert result.error.code == RESULT_TOO_LARGE
    assert f"({fit.oversize} bytes)" in result.error.message
    assert (result.duration.seconds, result.duration.nanos) == (1, 500_000_000)
    assert not result.writeback.sent_files and not result.output
