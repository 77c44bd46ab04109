"""The gates a run passes before its START (the seam approval and lanes wait in): a run
waiting in one is listed in its phase, can be stopped, and may be ended by its gate without
its tool ever running; the time waited is the receipt's ``queued_seconds``."""

from __future__ import annotations

import asyncio

from stargrpc import ToolContext, tool
from stargrpc.errors import ToolDenied
from stargrpc.principal import Principal
from stargrpc.registry import NoArguments, Registry, spec_of
from stargrpc.runs.outcome import Outcome
from stargrpc.runs.run import PHASE_QUEUED, PHASE_RUNNING, Run
from stargrpc.runs.runtime import RunRequest, Runtime
from stargrpc.v1 import events_pb2

CALLS: list[str] = []


@tool()
async def noted(ctx: ToolContext, args: NoArguments) -> str:
    """Notes that its body ran."""
    CALLS.append(ctx.run_id)
    return "ran"


async def _events(run: Run) -> list[events_pb2.RunEvent]:
    return [event async for event in run.log.follow(0)]


async def _admitted(runtime: Runtime) -> Run:
    admitted = await runtime.admit(RunRequest(tool_name="noted", arguments={}),
                                   Principal("tester"))
    assert admitted.run is not None
    return admitted.run


def _runtime_with_gate(gate: object) -> Runtime:
    runtime = Runtime(Registry([spec_of(noted)]))
    original = runtime._start

    def start_gated(input):  # type: ignore[no-untyped-def]
        input.run.gates = [gate]
        return original(input)

    runtime._start = start_gated  # type: ignore[method-assign]
    return runtime


async def test_a_run_starts_its_tool_only_once_its_gate_opens() -> None:
    CALLS.clear()
    opened = asyncio.Event()
    waiting = asyncio.Event()

    async def gate(run: Run) -> None:
        run.phase = PHASE_QUEUED
        waiting.set()
        await opened.wait()

    run = await _admitted(_runtime_with_gate(gate))
    await asyncio.wait_for(waiting.wait(), 10)
    assert run.phase == PHASE_QUEUED and not CALLS
    opened.set()
    result = await asyncio.wait_for(run.wait(), 10)
    assert result.outcome == events_pb2.OUTCOME_OK
    assert [run.run_id] == CALLS
    assert run.phase == PHASE_RUNNING
    assert result.usage.queued_seconds > 0
    phases = [e.step.phase for e in await _events(run) if e.HasField("step")]
    assert phases[0] == events_pb2.STEP_PHASE_START


async def test_a_run_stopped_in_its_gate_ends_cancelled_without_a_step() -> None:
    CALLS.clear()
    waiting = asyncio.Event()

    async def gate(run: Run) -> None:
        waiting.set()
        await asyncio.Event().wait()  # never opens

    run = await _admitted(_runtime_with_gate(gate))
    await asyncio.wait_for(waiting.wait(), 10)
    assert run.stop(Outcome.CANCELLED, "CANCELLED", "not any more")
    result = await asyncio.wait_for(run.wait(), 10)
    assert result.outcome == events_pb2.OUTCOME_CANCELLED
    assert result.error.code == "CANCELLED" and not CALLS
    assert not [e for e in await _events(run) if e.HasField("step")]


async def test_a_gate_that_refuses_ends_the_run_with_its_outcome() -> None:
    CALLS.clear()

    async def gate(run: Run) -> None:
        raise ToolDenied("nobody said yes")

    run = await _admitted(_runtime_with_gate(gate))
    result = await asyncio.wait_for(run.wait(), 10)
    assert result.outcome == events_pb2.OUTCOME_DENIED
    assert result.error.message == "nobody said yes" and not CALLS
