"""An MCP server written with the official SDK, for tests/mcp/test_upstream.py: served in
the test's event loop over streamable HTTP (:func:`serve_http`), or run as a script over
stdio (``python upstream_server.py``, inside the sandbox)."""

from __future__ import annotations

import asyncio
import base64
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import uvicorn
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.mcpserver.utilities.types import Image

#: A 1x1 PNG.
PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg==")


@dataclass
class Observed:
    """What the HTTP server saw (read by the tests in the same process)."""

    calls: list[str] = field(default_factory=list)
    hanging: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)


def build(observed: Observed) -> MCPServer:
    """The server: progress, hang, fail, image, crash and cancelled tools."""
    server = MCPServer("upstream-test")

    @server.tool()
    async def progress(steps: int, ctx: Context) -> str:
        """Counts to steps, reporting progress and logging each step."""
        observed.calls.append("progress")
        for step in range(1, steps + 1):
            await ctx.report_progress(step, steps, f"step {step}")
            await ctx.info(f"did step {step}")
        return f"counted to {steps}"

    @server.tool()
    async def hang() -> str:
        """Never answers (until cancelled)."""
        observed.calls.append("hang")
        observed.hanging.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            observed.cancelled.set()
            raise
        return "unreachable"

    @server.tool()
    async def fail() -> str:
        """Always fails."""
        observed.calls.append("fail")
        raise ToolError("the upstream tool failed on purpose")

    @server.tool()
    async def image() -> Image:
        """Returns a PNG."""
        observed.calls.append("image")
        return Image(data=PNG, format="png")

    @server.tool()
    async def crash() -> str:
        """Exits the server process mid-call."""
        os._exit(3)

    @server.tool()
    async def was_cancelled() -> bool:
        """Whether a hang call has been cancelled."""
        return observed.cancelled.is_set()

    return server


@asynccontextmanager
async def serve_http(port: int = 0) -> AsyncIterator[tuple[str, Observed, uvicorn.Server]]:
    """The server over streamable HTTP on 127.0.0.1 (``port`` 0 picks one), in this loop."""
    observed = Observed()
    app = build(observed).streamable_http_app()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="on"))
    task = asyncio.create_task(server.serve())
    for _ in range(500):
        if server.started or task.done():
            break
        await asyncio.sleep(0.01)
    assert server.started, "the upstream HTTP server did not start"
    bound = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{bound}/mcp", observed, server
    finally:
        server.should_exit = True
        server.force_exit = True
        await asyncio.wait([task], timeout=10)


if __name__ == "__main__":
    build(Observed()).run("stdio")
