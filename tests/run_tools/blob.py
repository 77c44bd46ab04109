"""blob: sends back a file of deterministic pseudo-random bytes."""

from __future__ import annotations

import hashlib
import random

from pydantic import BaseModel, Field

from stargrpc import ToolContext, tool


class BlobArgs(BaseModel):
    size: int = Field(ge=0, le=200 * 1024 * 1024, description="Bytes in the file.")
    seed: int = Field(0, description="Seed of the content.")


def blob_bytes(size: int, seed: int) -> bytes:
    """The content ``blob`` sends for ``size`` and ``seed``."""
    return random.Random(seed).randbytes(size)


@tool(kind="test")
async def blob(ctx: ToolContext, args: BlobArgs) -> str:
    """Send a file of pseudo-random bytes; the output is its sha256."""
    data = blob_bytes(args.size, args.seed)
    ctx.send_file("blob.bin", data, "application/octet-stream")
    return hashlib.sha256(data).hexdigest()
