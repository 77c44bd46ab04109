"""stargrpc: a gRPC service that executes tools for AI agent runtimes.

The public API for tool authors::

    from pydantic import BaseModel, Field
    from stargrpc import ToolContext, tool

    class EchoArgs(BaseModel):
        text: str = Field(description="What to say back.")

    @tool(kind="demo", read_only=True)
    async def echo(ctx: ToolContext, args: EchoArgs) -> str:
        \"\"\"Say the text back.\"\"\"
        return args.text
"""

from __future__ import annotations

from stargrpc.context import Step, SyncStep, SyncToolContext, ToolContext
from stargrpc.errors import ToolDenied, ToolFailed
from stargrpc.outcome import Outcome, ToolResult
from stargrpc.principal import Principal
from stargrpc.registry import tool

__version__ = "0.1.0"

__all__ = [
    "Outcome",
    "Principal",
    "Step",
    "SyncStep",
    "SyncToolContext",
    "ToolContext",
    "ToolDenied",
    "ToolFailed",
    "ToolResult",
    "__version__",
    "tool",
]
