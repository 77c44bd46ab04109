"""sleep: waits, heartbeating with its progress while it does."""

from __future__ import annotations

import asyncio

from pydantic import BaseModel, Field

from stargrpc import ToolContext, tool


class SleepArgs(BaseModel):
    seconds: float = Field(ge=0, le=3600, description="How long to wait.")
    heartbeat_every: float = Field(1.0, gt=0, le=60, description="Seconds between heartbeats.")


@tool(kind="demo", read_only=True, idempotent=True)
async def sleep(ctx: ToolContext, args: SleepArgs) -> str:
    """Wait for a number of seconds, sending heartbeats with progress meanwhile."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    deadline = started + args.seconds
    while (left := deadline - loop.time()) > 0:
        await asyncio.sleep(min(left, args.heartbeat_every))
        elapsed = min(loop.time() - started, args.seconds)
        await ctx.heartbeat(f"slept {elapsed:.1f} of {args.seconds:g} s",
                            progress=elapsed / args.seconds if args.seconds else 1.0)
    return f"slept {args.seconds:g} s"
