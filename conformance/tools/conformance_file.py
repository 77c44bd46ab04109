"""conformance_file: sends back a file of deterministic bytes; the output is its sha256."""

from __future__ import annotations

import hashlib

from pydantic import BaseModel, Field

from stargrpc import ToolContext, tool


class FileArgs(BaseModel):
    size: int = Field(ge=0, le=64 * 1024 * 1024, description="Bytes in the file.")


@tool(kind="conformance", read_only=True, idempotent=True)
async def conformance_file(ctx: ToolContext, args: FileArgs) -> str:
    """Send a file of ``size`` bytes (byte i is i*7 mod 251); the output is its sha256."""
    data = bytes(i * 7 % 251 for i in range(args.size))
    ctx.send_file("conformance.bin", data, "application/octet-stream")
    return hashlib.sha256(data).hexdigest()
