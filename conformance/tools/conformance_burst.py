"""conformance_burst: streams many small deltas as fast as it can (for DELTA coalescing)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from stargrpc import ToolContext, tool


class BurstArgs(BaseModel):
    count: int = Field(ge=1, le=100_000, description="Deltas to send: 1, 2, … count.")


@tool(kind="conformance", read_only=True, idempotent=True)
async def conformance_burst(ctx: ToolContext, args: BurstArgs) -> str:
    """Stream "1\\n" … "count\\n", one delta each, without pausing."""
    for i in range(1, args.count + 1):
        await ctx.delta(f"{i}\n")
    return f"burst {args.count}"
