"""RunUsage and the receipt on their own: how reported figures add up, what stays unset,
and that fitting a Result keeps its receipt, even when the Result must become an error."""

from __future__ import annotations

import json

import pytest

from stargrpc.runs.context import SentFileRecord, WriteBack
from stargrpc.runs.event_sizes import RESULT_TOO_LARGE, EventSizes
from stargrpc.runs.outcome import Outcome, ToolResult
from stargrpc.runs.result_fit import fit_result
from stargrpc.runs.usage import RunUsage, fill_usage, usage_dict, usage_json
from stargrpc.v1 import events_pb2


def test_process_trees_add_up_and_keep_the_largest_peak() -> None:
    usage = RunUsage()
    usage.add_processes(cpu_user_seconds=0.5, cpu_system_seconds=0.25, peak_rss_bytes=100,
                        bytes_written=4096)
    usage.add_processes(cpu_user_seconds=1.0, cpu_system_seconds=0.0, peak_rss_bytes=50)
    usage.add_network(sent=10, received=20)
    usage.add_network(received=5)
    message = events_pb2.Usage()
    fill_usage(message, 2_500_000_000, usage)

    assert (message.cpu_user_seconds, message.cpu_system_seconds) == (1.5, 0.25)
    assert message.peak_rss_bytes == 100
    assert message.bytes_written == 4096  # the second tree's was not measured
    assert (message.network_bytes_sent, message.network_bytes_received) == (10, 25)
    assert (message.wall_seconds, message.queued_seconds, message.child_runs) == (2.5, 0, 0)


def test_what_nobody_reported_stays_unset() -> None:
    usage = RunUsage()
    usage.add_processes(peak_rss_bytes=7)  # CPU not measured, e.g. a command too short
    message = events_pb2.Usage()
    fill_usage(message, 1000, usage)

    assert message.peak_rss_bytes == 7
    assert not message.HasField("cpu_user_seconds")
    assert not message.HasField("network_bytes_sent")
    with pytest.raises(ValueError, match="negative"):
        usage.add_network(sent=-1)


def test_the_audit_json_holds_the_measured_figures_as_numbers() -> None:
    result = events_pb2.Result()
    fill_usage(result.usage, 1_000_000, None)
    result.usage.peak_rss_bytes = 2**40  # a 64-bit integer stays a number, not a string

    assert json.loads(usage_json(result)) == {"wall_seconds": 0.001, "queued_seconds": 0.0,
                                              "peak_rss_bytes": 2**40, "child_runs": 0}
    assert usage_json(events_pb2.Result()) == usage_json(None) == ""


def test_a_result_that_must_become_an_error_keeps_its_receipt() -> None:
    sizes = EventSizes(result_bytes=2000, delta_bytes=1000, label_chars=4096, detail_bytes=100)
    data = b"x" * 10
    writeback = WriteBack(sent_files=[SentFileRecord("r-f1", "f1", "text/plain", data, "0")])
    result = events_pb2.Result()
    usage = RunUsage()
    usage.add_network(sent=3, received=4)
    fill_usage(result.usage, 1_500_000_000, usage)

    fit = fit_result(result, ToolResult(outcome=Outcome.ERROR, error_message="m" * 4000),
                     writeback, run_id="r", duration_ns=1_500_000_000, sizes=sizes,
                     inline_file_bytes=4096)

    assert fit is not None and fit.oversize
    assert result.error.code == RESULT_TOO_LARGE
    assert result.usage.wall_seconds == 1.5
    assert (result.usage.network_bytes_sent, result.usage.network_bytes_received) == (3, 4)


def test_the_receipt_written_to_the_audit_is_json_of_the_measured_figures() -> None:
    result = events_pb2.Result()
    assert usage_json(result) == ""  # no receipt: nothing recorded
    usage = result.usage
    usage.wall_seconds, usage.queued_seconds, usage.child_runs = 1 / 3, 0.0, 0
    usage.cpu_user_seconds, usage.peak_rss_bytes = 1e-300, 2**63
    usage.network_bytes_received = 10**16

    text = usage_json(result)
    assert json.loads(text) == usage_dict(usage) == {
        "wall_seconds": 1 / 3, "queued_seconds": 0.0, "cpu_user_seconds": 1e-300,
        "peak_rss_bytes": 2**63, "network_bytes_received": 10**16, "child_runs": 0}
    assert " " not in text  # compact, in the contract's field order
    assert list(json.loads(text)) == [f.name for f, _ in usage.ListFields()]
