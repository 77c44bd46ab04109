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

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stargrpc.errors import ToolDenied, ToolFailed
    from stargrpc.principal import Principal
    from stargrpc.registry import tool
    from stargrpc.runs.context import SyncToolContext, SyncToolStep, ToolContext, ToolStep
    from stargrpc.runs.outcome import Outcome, ToolResult
    from stargrpc.runs.state import StateError
    from stargrpc.runs.trees import ChildResult, ChildRunError, ChildRunRefused

__version__ = "0.1.0"

# Loaded on first use (PEP 562), so that importing a light part of the package, such as
# ``stargrpc.client``, does not load the server (settings, registry, the run machinery).
_LAZY: dict[str, str] = {
    "ChildResult": "stargrpc.runs.trees",
    "ChildRunError": "stargrpc.runs.trees",
    "ChildRunRefused": "stargrpc.runs.trees",
    "Outcome": "stargrpc.runs.outcome",
    "Principal": "stargrpc.principal",
    "StateError": "stargrpc.runs.state",
    "SyncToolContext": "stargrpc.runs.context",
    "SyncToolStep": "stargrpc.runs.context",
    "ToolContext": "stargrpc.runs.context",
    "ToolDenied": "stargrpc.errors",
    "ToolFailed": "stargrpc.errors",
    "ToolResult": "stargrpc.runs.outcome",
    "ToolStep": "stargrpc.runs.context",
    "tool": "stargrpc.registry",
}

__all__ = [
    "ChildResult",
    "ChildRunError",
    "ChildRunRefused",
    "Outcome",
    "Principal",
    "StateError",
    "SyncToolContext",
    "SyncToolStep",
    "ToolContext",
    "ToolDenied",
    "ToolFailed",
    "ToolResult",
    "ToolStep",
    "__version__",
    "tool",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'stargrpc' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
