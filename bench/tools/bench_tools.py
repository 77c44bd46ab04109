"""The benchmark tools: one per measurement, each doing as little as its measurement allows.

Loaded with ``stargrpc serve --tools-dir bench/tools``; the bare baseline server
(``bench/baseline_server.py``) answers the same tool names with the same message shapes.
"""

from __future__ import annotations

import asyncio

from pydantic import BaseModel, Field

from stargrpc import ToolContext, tool

#: Width of one streamed delta ("0000001\n"): the client counts events inside the delta text
#: by this width, so coalesced deltas are still counted (and checked for order) one by one.
DELTA_WIDTH = 8


class StreamArgs(BaseModel):
    n: int = Field(20_000, ge=1, le=1_000_000, description="How many deltas to stream.")


class WaitArgs(BaseModel):
    ms: float = Field(10.0, ge=0, le=10_000, description="Milliseconds to await.")


class HoldArgs(BaseModel):
    seconds: float = Field(30.0, ge=0, le=3600, description="Seconds to sleep.")


@tool(kind="bench", read_only=True, idempotent=True)
async def bench_trivial(ctx: ToolContext) -> str:
    """Do nothing: the run is START, END and the Result (call latency)."""
    return ""


@tool(kind="bench", read_only=True, idempotent=True)
async def bench_stream(ctx: ToolContext, args: StreamArgs) -> str:
    """Stream ``n`` small deltas of fixed width on the top-level step (stream throughput)."""
    for i in range(1, args.n + 1):
        await ctx.delta(f"{i:07d}\n")
    return f"streamed {args.n}"


@tool(kind="bench", read_only=True, idempotent=True)
async def bench_wait(ctx: ToolContext, args: WaitArgs) -> str:
    """Await ``ms`` milliseconds, doing nothing else (concurrency)."""
    await asyncio.sleep(args.ms / 1000)
    return ""


@tool(kind="bench", read_only=True, idempotent=True)
async def bench_hold(ctx: ToolContext, args: HoldArgs) -> str:
    """Sleep ``seconds`` without a heartbeat (held streams: memory per open run)."""
    await asyncio.sleep(args.seconds)
    return ""
