"""echo: says its text back. The smallest useful tool."""

from __future__ import annotations

from pydantic import BaseModel, Field

from stargrpc import ToolContext, tool


class EchoArgs(BaseModel):
    text: str = Field(max_length=100_000, description="The text to say back.")


@tool(kind="demo", read_only=True, idempotent=True)
async def echo(ctx: ToolContext, args: EchoArgs) -> str:
    """Say the text back, unchanged."""
    await ctx.delta(args.text)
    return args.text
