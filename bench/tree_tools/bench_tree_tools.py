"""The call-tree benchmark's tool: a run that calls ``bench_trivial`` as a child run.

Loaded beside ``bench/tools`` by ``python -m bench.trees``.
"""

from __future__ import annotations

from stargrpc import ToolContext, tool


@tool(kind="bench", read_only=True, idempotent=True)
async def bench_call_trivial(ctx: ToolContext) -> str:
    """Call ``bench_trivial`` once as a child run (``ctx.call``) and return nothing."""
    await ctx.call("bench_trivial")
    return ""
