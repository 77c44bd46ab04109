"""conformance_number: says an integer back, digit for digit (big integers need arguments_json)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from stargrpc import ToolContext, tool


class NumberArgs(BaseModel):
    value: int = Field(description="Any integer, however large.")


@tool(kind="conformance", read_only=True, idempotent=True)
async def conformance_number(ctx: ToolContext, args: NumberArgs) -> str:
    """Return the integer's decimal digits."""
    return str(args.value)
