"""The runtime's own bookkeeping: drain, and runs leaving it however they end."""

from __future__ import annotations

import asyncio

from stargrpc import ToolContext, tool
from stargrpc.outcome import Outcome
from stargrpc.principal import Principal
from stargrpc.registry import NoArguments, Registry, spec_of
from stargrpc.runtime import RunRequest, Runtime
from stargrpc.v1 import events_pb2

STARTED = asyncio.Event()
RELEASE = asyncio.Event()


@tool()
async def stubborn(ctx: ToolContext, args: NoArguments) -> str:
    """Swallows every cancellation until released."""
    STARTED.set()
    while not RELEASE.is_set():
        try:
            await RELEASE.wait()
        except asyncio.CancelledError:
            continue
    return "released"


async def test_drain_returns_once_a_stopped_run_has_ended_without_its_stubborn_tool() -> None:
    STARTED.clear()
    RELEASE.clear()
    runtime = Runtime(Registry([spec_of(stubborn)]))
    admitted = await runtime.admit(RunRequest(tool_name="stubborn", arguments={}),
                                   Principal("tester"))
    run = admitted.run
    assert run is not None
    task = run.start()
    try:
        await asyncio.wait_for(STARTED.wait(), 10)
        draining = asyncio.create_task(runtime.drain(30))
        await asyncio.sleep(0)
        assert run.stop(Outcome.CANCELLED, "CANCELLED", "enough")
        # The run ends without its tool after the stop grace; drain must not wait for the
        # tool (which never ends) until its own 30 s grace is over.
        async with asyncio.timeout(15):
            await draining
        assert run.result is not None
        assert run.result.outcome == events_pb2.OUTCOME_CANCELLED
        assert not task.done()  # the tool still holds the run's task
        assert runtime.runs == {}
    finally:
        RELEASE.set()  # let the stubborn task end, or the event loop cannot close
        await asyncio.wait_for(task, 10)
