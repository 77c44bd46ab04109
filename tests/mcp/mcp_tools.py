"""Tools for the MCP tests: steps with deltas, waits at a gate the test opens (heartbeating,
or silent), structured output, files, a failure."""

from __future__ import annotations

import asyncio
import contextlib

from pydantic import BaseModel, Field

from stargrpc import ToolContext, ToolResult, tool
from stargrpc.registry import Registry, load_registry, spec_of
from tests.auth_tools import ops_only, whoami

#: Gates by name; a test opens its gate to let ``wait_at_gate`` finish.
GATES: dict[str, asyncio.Event] = {}

#: Set when the run of ``wait_at_gate`` at that gate is cancelled.
CANCELLED: dict[str, asyncio.Event] = {}

#: Runs of ``tally`` so far.
TALLY = [0]


class GateArgs(BaseModel):
    gate: str = Field(description="The gate to wait at.")


@tool(kind="test")
async def wait_at_gate(ctx: ToolContext, args: GateArgs) -> str:
    """A step with a delta, then a wait (heartbeating) until the test opens the gate."""
    try:
        async with ctx.step("Preparing") as step:
            await step.delta("ready\n")
        while not GATES[args.gate].is_set():
            await ctx.heartbeat("waiting at the gate", progress=0.5)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(GATES[args.gate].wait(), 0.2)
    except asyncio.CancelledError:
        CANCELLED[args.gate].set()
        raise
    return "through the gate"


@tool(kind="test")
async def pause_at_gate(ctx: ToolContext, args: GateArgs) -> str:
    """A step with a delta, a silent wait until the test opens the gate (no event at all),
    then another step."""
    async with ctx.step("Preparing") as step:
        await step.delta("ready")
    await GATES[args.gate].wait()
    async with ctx.step("Finishing") as step:
        await step.delta("done")
    return "through the gate"


class Point(BaseModel):
    x: int
    y: int


class MeasureArgs(BaseModel):
    size: int = Field(ge=1, le=100, description="How big.")


@tool(kind="test", read_only=True, idempotent=True, output_model=Point)
async def measure(ctx: ToolContext, args: MeasureArgs) -> Point:
    """Measure something: structured output, and a picture and a note as files."""
    ctx.send_file("note.txt", b"measured\n", "text/plain")
    ctx.send_file("dot.png", b"\x89PNG\r\n\x1a\nfake", "image/png")
    return Point(x=args.size, y=args.size * 2)


@tool(kind="test", destructive=True)
async def breaks(ctx: ToolContext) -> str:
    """Always fails."""
    raise RuntimeError("the internals of the failure")


#: A file bigger than the chunked-files test lets travel inline.
BIG = ("\n".join(str(i) for i in range(1500)) + "\n").encode()


@tool(kind="test")
async def big_file(ctx: ToolContext) -> str:
    """Send a file large enough to travel in chunks."""
    ctx.send_file("numbers.txt", BIG, "text/plain")
    return "sent"


@tool(kind="test")
async def tally(ctx: ToolContext) -> str:
    """Count its own runs."""
    TALLY[0] += 1
    return f"run {TALLY[0]}"


class LongArgs(BaseModel):
    chars: int = Field(ge=1, le=1_000_000, description="How many characters.")


def long_text(chars: int) -> str:
    """``chars`` characters of numbered lines, so that any cut shows where it fell."""
    lines: list[str] = []
    total = 0
    number = 0
    while total < chars:
        line = f"line {number:07d}\n"
        lines.append(line)
        total += len(line)
        number += 1
    return "".join(lines)[:chars]


@tool(kind="test", name="long_text")
async def long_text_tool(ctx: ToolContext, args: LongArgs) -> str:
    """Return a long text."""
    return long_text(args.chars)


@tool(kind="test")
async def facts(ctx: ToolContext) -> ToolResult:
    """Text for the model, and facts about the run beside it (no output schema)."""
    return ToolResult(output="the answer is 42", structured={"took_ms": 5, "cached": False})


@tool(kind="test")
async def data(ctx: ToolContext) -> dict[str, object]:
    """Return data without declaring an output schema: its text is that data as JSON."""
    return {"a": 1, "b": [1, 2.5], "c": "three"}


def mcp_registry() -> Registry:
    """The bundled tools, the tools above, and whoami and ops_only (roles: ops)."""
    bundled = load_registry(bundled=True, entry_points=False)
    extra = [spec_of(fn) for fn in (wait_at_gate, pause_at_gate, measure, breaks, big_file,
                                    tally, whoami, ops_only, long_text_tool, facts, data)]
    return Registry([*bundled.values(), *(spec for spec in extra if spec is not None)])
