"""The typed views of the contract's messages, and the package's public names."""

from __future__ import annotations

import datetime as dt

from google.protobuf import json_format

import stargrpc.client
from stargrpc.client import (
    Event,
    FileChunk,
    Heartbeat,
    Notice,
    Outcome,
    Result,
    StepDelta,
    event_from_proto,
)
from stargrpc.v1 import events_pb2


def _event(**fields: object) -> events_pb2.RunEvent:
    return json_format.ParseDict({"run_id": "r1", "seq": "7", **fields}, events_pb2.RunEvent())


def test_every_kind_of_event_has_its_type_and_fields() -> None:
    delta = event_from_proto(_event(
        time="2026-01-02T03:04:05.5Z", critic_time_left="12.5s",
        step={"phase": "STEP_PHASE_DELTA", "delta": "oops\n", "channel": "stderr",
              "step": {"id": "s1", "parent_id": "s0", "status": "STEP_STATUS_RUNNING",
                       "detail": {"n": 1}}}))
    beat = event_from_proto(_event(heartbeat={"message": "working", "progress": 0.25}))
    bare = event_from_proto(_event(heartbeat={}))
    notice = event_from_proto(_event(notice={"level": "NOTICE_LEVEL_WARNING",
                                             "code": "CRITIC_NO_PROGRESS", "message": "45 s"}))
    chunk = event_from_proto(_event(file_chunk={"file_id": "f1", "offset": "4",
                                                 "data": "aGk=", "last": True}))
    unknown = event_from_proto(_event())

    assert isinstance(delta, StepDelta)
    assert (delta.run_id, delta.seq, delta.text, delta.channel) == ("r1", 7, "oops\n", "stderr")
    assert delta.time == dt.datetime(2026, 1, 2, 3, 4, 5, 500000, tzinfo=dt.UTC)
    assert delta.critic_time_left == 12.5
    assert (delta.step.parent_id, delta.step.status, delta.step.detail) == (
        "s0", "RUNNING", {"n": 1})
    assert isinstance(beat, Heartbeat) and (beat.message, beat.progress) == ("working", 0.25)
    assert isinstance(bare, Heartbeat) and bare.progress is None and bare.time is None
    assert isinstance(notice, Notice)
    assert (notice.level, notice.code, notice.message) == ("WARNING", "CRITIC_NO_PROGRESS",
                                                           "45 s")
    assert isinstance(chunk, FileChunk) and (chunk.offset, chunk.data, chunk.last) == (
        4, b"hi", True)
    assert type(unknown) is Event  # a kind this client does not know yet still comes through


def test_the_result_carries_outcome_output_and_write_back() -> None:
    result = event_from_proto(_event(result={
        "outcome": "OUTCOME_FAILED", "output": "partial", "structured_output": {"rows": [1, 2]},
        "error": {"code": "TOOL_FAILED", "message": "disk full"}, "duration": "1.5s",
        "writeback": {
            "sent_files": [{"file_id": "f1", "name": "a.txt", "mime_type": "text/plain",
                            "size": "2", "sha256": "ab", "content": "aGk="}],
            "injected_tools": [{"name": "t", "description": "d",
                                "input_schema": {"type": "object"}}],
            "sent_rich_messages": [{"kind": "card", "payload": {"title": "x"}}],
        }}))

    assert isinstance(result, Result)
    assert result.outcome is Outcome.FAILED and not result.ok
    assert (result.output, result.structured_output) == ("partial", {"rows": [1, 2]})
    assert (result.error_code, result.error_message, result.duration) == (
        "TOOL_FAILED", "disk full", 1.5)
    assert [(f.name, f.size, f.content) for f in result.files] == [("a.txt", 2, b"hi")]
    assert result.injected_tools[0].input_schema == {"type": "object"}
    assert result.rich_messages[0].payload == {"title": "x"}


def test_all_names_the_public_api_and_nothing_else() -> None:
    public = {name for name in dir(stargrpc.client)
              if not name.startswith("_") and name not in {
                  "aio", "channel", "errors", "events", "registry", "retry", "sync",
                  "annotations"}}
    assert set(stargrpc.client.__all__) == public
