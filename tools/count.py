"""count: counts up to a number, one delta per number, inside a step of its own."""

from __future__ import annotations

import asyncio

from pydantic import BaseModel, Field

from stargrpc import ToolContext, tool


class CountArgs(BaseModel):
    to: int = Field(ge=1, le=100_000, description="Count up to this number.")
    delay: float = Field(0.0, ge=0, le=60, description="Seconds to wait between numbers.")


@tool(kind="demo", read_only=True, idempotent=True)
async def count(ctx: ToolContext, args: CountArgs) -> str:
    """Count from 1 to a number, streaming one delta per number."""
    async with ctx.step(f"Counting to {args.to}") as step:
        for i in range(1, args.to + 1):
            if args.delay and i > 1:
                await asyncio.sleep(args.delay)
            await step.delta(f"{i}\n")
    return f"counted to {args.to}"
