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
from typing import Any

import uvicorn
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.mcpserver.utilities.types import Image
from mcp_types import ToolAnnotations

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

    @server.tool(annotations=ToolAnnotations(readOnlyHint=True))
    async def peek() -> str:
        """Reads, changes nothing (annotated read-only)."""
        return "peeked"

    @server.tool(annotations=ToolAnnotations(destructiveHint=False))
    async def append() -> str:
        """Adds, never overwrites (annotated not destructive)."""
        return "appended"

    @server.tool()
    async def was_cancelled() -> bool:
        """Whether a hang call has been cancelled."""
        return observed.cancelled.is_set()

    return server


#: The self-referencing input schema of issue 25: every validation of it recurses forever.
SELF_REFERENCING = {"type": "object", "$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
#: A legitimate recursive schema: each turn of the loop moves into the arguments.
TREE = {"type": "object", "$ref": "#/$defs/node", "$defs": {"node": {
    "type": "object",
    "properties": {"children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}}}


def _chain(links: int) -> dict[str, Any]:
    """A schema whose every level of the arguments (``{"x": {"x": …}}``) goes through a
    chain of ``links`` references before moving on: finite, but as deep as the arguments
    times ``links``."""
    defs: dict[str, Any] = {f"n{i}": {"$ref": f"#/$defs/n{i + 1}"} for i in range(links)}
    defs[f"n{links}"] = {"type": "object", "properties": {"x": {"$ref": "#/$defs/n0"}}}
    return {"type": "object", "$ref": "#/$defs/n0", "$defs": defs}


def _nested(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object"}
    for _ in range(levels):
        schema = {"allOf": [schema]}
    return {"type": "object", **schema}


def build_hostile(observed: Observed, *, bulk: int = 0) -> MCPServer:
    """A server that lists what no server should (each schema with the top-level ``type``
    the SDK insists on): a 6 MiB description, schemas that loop,
    nest or refer elsewhere, a tool that floods progress, one that floods log messages, and
    ``bulk`` more tools (the
    first 80 with 60 KiB schemas); ``fine`` is an ordinary tool beside them."""
    server = MCPServer("upstream-hostile")

    @server.tool()
    async def fine(text: str) -> str:
        """Echoes text."""
        observed.calls.append("fine")
        return f"fine: {text}"

    @server.tool()
    async def flood(count: int, ctx: Context) -> str:
        """Reports progress count times."""
        observed.calls.append("flood")
        for step in range(1, count + 1):
            await ctx.report_progress(step, count, f"step {step}")
        return f"flooded {count}"

    @server.tool()
    async def chatter(count: int, size: int, ctx: Context) -> str:
        """Logs count messages of size characters each."""
        observed.calls.append("chatter")
        for index in range(count):
            await ctx.info(f"{index:06d} " + "z" * size)
        return f"chattered {count}"

    async def anything(children: list[Any] | None = None, x: Any = None) -> str:
        observed.calls.append("anything")
        return "called"

    def add(name: str, schema: dict[str, Any] | None = None, description: str = "") -> None:
        server.add_tool(anything, name=name, description=description or f"The {name} tool.")
        if schema is not None:
            server._tool_manager.get_tool(name).parameters = schema  # as a server may say

    add("huge", description="A tool. " + "x" * (6 * 1024 * 1024))
    add("self_ref", SELF_REFERENCING)
    add("deep", _nested(60))  # deeper and the SDK cannot parse the list
    add("remote_ref", {"type": "object", "$ref": "http://169.254.169.254/latest/schema.json"})
    add("bad_pattern", {"type": "object", "properties": {"a": {"type": "string",
                                                                "pattern": "(unclosed"}}})
    add("tree", TREE)
    add("costly", _chain(30))
    big = {"type": "object", "properties": {
        f"p{i}": {"type": "string", "description": f"{i} " + "y" * 1000} for i in range(60)}}
    for index in range(bulk):
        add(f"bulk_{index:03}", big if index < 80 else None)
    return server


@asynccontextmanager
async def serve_http(port: int = 0, *, hostile: bool = False, bulk: int = 0
                     ) -> AsyncIterator[tuple[str, Observed, uvicorn.Server]]:
    """The server over streamable HTTP on 127.0.0.1 (``port`` 0 picks one), in this loop;
    ``hostile``: :func:`build_hostile`'s instead."""
    observed = Observed()
    built = build_hostile(observed, bulk=bulk) if hostile else build(observed)
    app = built.streamable_http_app()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="on"))
    task = asyncio.create_task(server.serve())
    from tests.helpers import eventually  # here: run as a script, there is no tests package

    await eventually(lambda: server.started or task.done(), within=5,
                     what="the upstream HTTP server started")
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
