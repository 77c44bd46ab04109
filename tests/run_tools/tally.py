"""tally: records each time it runs (one line in a file), so tests can count real runs."""

from __future__ import annotations

import asyncio
from pathlib import Path

from pydantic import BaseModel, Field

from stargrpc import ToolContext, tool


class TallyArgs(BaseModel):
    path: str = Field(description="File that gets one line per run.")
    deltas: int = Field(3, ge=0, le=10_000, description="Deltas to stream.")
    gate: str = Field("", description="Wait until this file exists before returning.")


def _record(path: str, line: str) -> None:
    with Path(path).open("a") as tally_file:  # tiny local write: fine on the loop in a test
        tally_file.write(line + "\n")


def _is_open(gate: str) -> bool:
    return not gate or Path(gate).exists()


@tool(kind="test")
async def tally(ctx: ToolContext, args: TallyArgs) -> str:
    """Append a line to a file, stream some deltas, optionally wait for a gate file."""
    _record(args.path, ctx.run_id)
    async with ctx.step("Tallying") as step:
        for i in range(args.deltas):
            await step.delta(f"{i}\n")
    while not _is_open(args.gate):
        # Another process opens the gate; there is no event to await across processes.
        await ctx.heartbeat("waiting for the gate")
        await asyncio.sleep(0.05)
    return f"tallied {args.deltas}"
