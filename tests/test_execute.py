"""Execute through a real server: event order, gapless seq, nesting, outcomes."""

from __future__ import annotations

from stargrpc.v1 import events_pb2
from tests.helpers import phases, run_tool


async def test_count_streams_nested_steps_then_one_result(stub) -> None:
    events = await run_tool(stub, "count", {"to": 3})

    assert phases(events) == [
        "START s0", "START s1", "DELTA s1 '1\\n'", "DELTA s1 '2\\n'", "DELTA s1 '3\\n'",
        "END s1 COMPLETE", "END s0 COMPLETE", "RESULT OK",
    ]
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert len({e.run_id for e in events}) == 1
    assert events[1].step.step.parent_id == "s0"
    assert events[0].step.step.parent_id == ""
    assert events[-1].result.output == "counted to 3"


async def test_echo_says_text_back(stub) -> None:
    events = await run_tool(stub, "echo", {"text": "hi"})

    assert phases(events) == ["START s0", "DELTA s0 'hi'", "END s0 COMPLETE", "RESULT OK"]
    assert events[-1].result.output == "hi"
    assert sum(e.HasField("result") for e in events) == 1
    assert events[-1].result.outcome == events_pb2.OUTCOME_OK
