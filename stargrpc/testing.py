"""Test one tool without a server: run it, record its events, look at the result.

::

    from stargrpc.testing import run_tool
    from tools.count import count

    async def test_count():
        recorded = await run_tool(count, {"to": 2})
        assert recorded.outcome is Outcome.OK
        assert recorded.deltas == "1\\n2\\n"

The run goes through the same machinery as on a server (argument validation, the run
pipeline with its supervision by the critic, the run's event log, outcome classification),
so what passes here behaves the same behind gRPC.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from stargrpc.errors import ToolDefinitionError
from stargrpc.outcome import Outcome
from stargrpc.principal import Principal
from stargrpc.registry import Registry, ToolSpec, spec_of
from stargrpc.run import Run
from stargrpc.runtime import ExecuteCall, Runtime
from stargrpc.settings import Settings
from stargrpc.v1 import events_pb2

#: The principal tools see in the harness unless the test gives another.
TEST_PRINCIPAL = Principal(id="test", roles=frozenset({"admin"}), method="test")


@dataclass(frozen=True)
class RecordedRun:
    """Everything one run emitted.

    Attributes:
        events: Every event, in order (the last is the Result).
        result: The Result message.
    """

    events: list[events_pb2.RunEvent]
    result: events_pb2.Result

    @property
    def outcome(self) -> Outcome:
        """How the run ended."""
        return Outcome(self.result.outcome)

    @property
    def output(self) -> str:
        """The text for the model."""
        return self.result.output

    @property
    def deltas(self) -> str:
        """All streamed output, concatenated."""
        return "".join(e.step.delta for e in self.events
                       if e.HasField("step") and e.step.phase == events_pb2.STEP_PHASE_DELTA)

    @property
    def step_titles(self) -> list[str]:
        """Titles of the steps started, in order (the tool call itself first)."""
        return [e.step.step.title for e in self.events
                if e.HasField("step") and e.step.phase == events_pb2.STEP_PHASE_START]

    @property
    def heartbeats(self) -> list[events_pb2.Heartbeat]:
        """The heartbeats sent."""
        return [e.heartbeat for e in self.events if e.HasField("heartbeat")]


def _spec(tool: Callable[..., Any] | ToolSpec) -> ToolSpec:
    if isinstance(tool, ToolSpec):
        return tool
    spec = spec_of(tool)
    if spec is None:
        raise ToolDefinitionError(f"{getattr(tool, '__name__', tool)!r} is not a @tool() function")
    return spec


async def run_tool(tool: Callable[..., Any] | ToolSpec,
                   arguments: Mapping[str, Any] | BaseModel | None = None, *,
                   principal: Principal = TEST_PRINCIPAL, settings: Settings | None = None,
                   invocation: Mapping[str, Any] | None = None,
                   on_start: Callable[[Run], None] | None = None) -> RecordedRun:
    """Runs one tool to its end and records its events.

    Args:
        tool: A ``@tool()`` function or its spec.
        arguments: A dict (validated exactly as the server would: lenient coercion, unknown
            fields rejected) or an instance of the tool's argument model.
        principal: Who the tool sees as caller.
        settings: Server settings the tool reads through ``ctx.settings``.
        invocation: The invocation context (end user, channel, labels …).
        on_start: Called with the run just after it starts (e.g. to cancel it later with
            ``run.stop(...)``).

    Raises:
        InvalidArgument: The arguments do not fit the tool's model.
        CriticConfigError: The tool's critic (or the settings') cannot be loaded.
    """
    spec = _spec(tool)
    if isinstance(arguments, BaseModel):
        arguments = arguments.model_dump(mode="json", by_alias=True)
    runtime = Runtime(Registry([spec]), settings=settings)
    call = ExecuteCall(tool_name=spec.name, arguments=dict(arguments or {}),
                       invocation=dict(invocation or {}))
    try:
        submitted = await runtime.submit(call, principal)
        run = submitted.run
        assert run is not None  # no idempotency key: always a new run
        if on_start is not None:
            on_start(run)
        result = await run.wait()
        events = [event async for event in run.log.follow(0)]
    finally:
        await runtime.aclose()
    return RecordedRun(events=events, result=result)


def run_tool_sync(tool: Callable[..., Any] | ToolSpec,
                  arguments: Mapping[str, Any] | BaseModel | None = None,
                  **options: Any) -> RecordedRun:
    """:func:`run_tool` for synchronous tests."""
    return asyncio.run(run_tool(tool, arguments, **options))


__all__ = ["TEST_PRINCIPAL", "RecordedRun", "run_tool", "run_tool_sync"]
