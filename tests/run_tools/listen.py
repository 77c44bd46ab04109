"""listen, listen_sync: wait for steering messages and echo each as a delta."""

from __future__ import annotations

from pydantic import BaseModel, Field

from stargrpc import SyncToolContext, ToolContext, tool


class ListenArgs(BaseModel):
    count: int = Field(1, ge=1, le=100, description="Steering messages to wait for.")


@tool(kind="test")
async def listen(ctx: ToolContext, args: ListenArgs) -> str:
    """Wait for `count` steering messages (ctx.steering()) and echo each as a delta."""
    await ctx.delta("listening\n")
    got: list[str] = []
    async for message in ctx.steering():
        got.append(message)
        await ctx.delta(f"steered: {message}\n")
        if len(got) == args.count:
            break
    return " | ".join(got)


@tool(kind="test")
def listen_sync(ctx: SyncToolContext, args: ListenArgs) -> str:
    """The same as listen, as a plain def tool (ctx.steering() blocking, with a timeout)."""
    ctx.delta("listening\n")
    got: list[str] = []
    for message in ctx.steering(timeout=30):
        got.append(message)
        ctx.delta(f"steered: {message}\n")
        if len(got) == args.count:
            break
    got.extend(ctx.steering_pending())
    return " | ".join(got)
