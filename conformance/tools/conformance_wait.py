"""conformance_wait: waits, heartbeating, so a caller can cancel it or let its deadline pass."""

from __future__ import annotations

import asyncio

from pydantic import BaseModel, Field

from stargrpc import ToolContext, tool


class WaitArgs(BaseModel):
    seconds: float = Field(ge=0, le=600, description="How long to wait.")


@tool(kind="conformance", read_only=True, idempotent=True)
async def conformance_wait(ctx: ToolContext, args: WaitArgs) -> str:
    """Wait for a number of seconds, with a heartbeat every 50 ms."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + args.seconds
    while (left := deadline - loop.time()) > 0:
        await ctx.heartbeat("waiting")
        await asyncio.sleep(min(left, 0.05))
    return f"waited {args.seconds:g} s"
