"""conformance_steps: nested steps (an outer step holding an inner one) with numbered deltas."""

from __future__ import annotations

import asyncio

from pydantic import BaseModel, Field

from stargrpc import ToolContext, tool


class StepsArgs(BaseModel):
    items: int = Field(ge=1, le=10_000, description="Deltas of the inner step: 1, 2, … items.")
    delay: float = Field(0.0, ge=0, le=10, description="Seconds to wait before each delta but the first.")


@tool(kind="conformance", read_only=True, idempotent=True)
async def conformance_steps(ctx: ToolContext, args: StepsArgs) -> str:
    """An outer step holding an inner step that streams "1\\n" … "items\\n"."""
    async with ctx.step("Outer") as outer:
        async with ctx.step("Inner", parent=outer) as inner:
            for i in range(1, args.items + 1):
                if args.delay and i > 1:
                    await asyncio.sleep(args.delay)
                await inner.delta(f"{i}\n")
        await outer.delta("done\n")
    return f"steps {args.items}"
