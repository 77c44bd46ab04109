"""Test tools shared by the critic's tests."""

from __future__ import annotations

import asyncio

from stargrpc import ToolContext, tool


@tool()
async def hangs(ctx: ToolContext) -> str:
    """Say something, then wait forever."""
    await ctx.delta("partial output")
    await asyncio.Event().wait()
    return "unreachable"


@tool(soft_timeout=0.4)
async def impatient(ctx: ToolContext) -> str:
    """Hangs, with a short soft timeout of its own."""
    await asyncio.Event().wait()
    return "unreachable"
