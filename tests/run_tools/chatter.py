"""chatter: waits for a gate file, streams many deltas quickly, then (given a hold file)
says "sent" and waits for the hold file before it returns."""

from __future__ import annotations

import asyncio
from pathlib import Path

from pydantic import BaseModel, Field

from stargrpc import ToolContext, tool


class ChatterArgs(BaseModel):
    count: int = Field(ge=0, le=100_000, description="Deltas to send.")
    size: int = Field(100, ge=1, le=1_000_000, description="Characters per delta.")
    gate: str = Field("", description="Wait for this file before sending the deltas.")
    hold: str = Field("", description="After the deltas, say 'sent' and wait for this file.")


def _is_open(gate: str) -> bool:
    return not gate or Path(gate).exists()


@tool(kind="test")
async def chatter(ctx: ToolContext, args: ChatterArgs) -> str:
    """Send ``count`` deltas of ``size`` characters."""
    while not _is_open(args.gate):
        await ctx.heartbeat("waiting for the gate")
        await asyncio.sleep(0.02)
    text = "x" * args.size
    for _ in range(args.count):
        await ctx.delta(text)
    if args.hold:
        await ctx.heartbeat("sent")
        while not _is_open(args.hold):
            await ctx.heartbeat("holding")
            await asyncio.sleep(0.02)
    return f"sent {args.count}"
