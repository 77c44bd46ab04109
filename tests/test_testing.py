"""The tool-author harness runs a tool without a server."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from stargrpc import Outcome, ToolContext, ToolFailed, tool
from stargrpc.errors import InvalidArgument
from stargrpc.testing import run_tool, run_tool_sync


class Args(BaseModel):
    n: int


@tool()
async def halves(ctx: ToolContext, args: Args) -> str:
    """Halve a number, refusing odd ones."""
    async with ctx.step("halving") as step:
        await step.delta(f"{args.n}/2\n")
    if args.n % 2:
        raise ToolFailed(f"{args.n} is odd")
    return str(args.n // 2)


@tool()
def shout(ctx, args: Args) -> str:
    """A plain def tool, run off the event loop."""
    ctx.delta("working")
    return "!" * args.n


async def test_records_steps_deltas_and_result() -> None:
    recorded = await run_tool(halves, {"n": "8"})

    assert recorded.outcome is Outcome.OK
    assert recorded.output == "4"
    assert recorded.deltas == "8/2\n"
    assert recorded.step_titles == ["halves", "halving"]
    assert [e.seq for e in recorded.events] == list(range(1, len(recorded.events) + 1))


async def test_failure_is_recorded_as_outcome() -> None:
    recorded = await run_tool(halves, {"n": 3})

    assert recorded.outcome is Outcome.FAILED
    assert recorded.result.error.message == "3 is odd"


async def test_bad_arguments_raise_like_the_server() -> None:
    with pytest.raises(InvalidArgument) as caught:
        await run_tool(halves, {"n": "x", "extra": 1})
    assert {v.field for v in caught.value.violations} == {"arguments.n", "arguments.extra"}


def test_sync_tool_and_sync_harness() -> None:
    recorded = run_tool_sync(shout, {"n": 3})

    assert recorded.output == "!!!"
    assert recorded.deltas == "working"


@tool()
async def chatty(ctx: ToolContext) -> str:
    """Logs through its context's logger."""
    ctx.logger.info("chatty_said", words=2)
    return "ok"


@tool()
def chatty_sync(ctx) -> str:
    """Logs through its context's logger, from a worker thread."""
    ctx.logger.info("chatty_sync_said")
    return "ok"


async def test_a_tools_logger_is_bound_with_its_run_and_tool() -> None:
    from structlog.testing import capture_logs

    with capture_logs() as logs:
        recorded = await run_tool(chatty, {})
        synced = await run_tool(chatty_sync, {})

    [line] = [entry for entry in logs if entry["event"] == "chatty_said"]
    assert line["tool"] == "chatty" and line["words"] == 2
    assert line["run_id"] == recorded.events[0].run_id
    [sync_line] = [entry for entry in logs if entry["event"] == "chatty_sync_said"]
    assert sync_line["tool"] == "chatty_sync"
    assert sync_line["run_id"] == synced.events[0].run_id
