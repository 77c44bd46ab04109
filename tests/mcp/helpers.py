"""What the tests of MCP servers behind stargrpc (mcp_servers) share: the networks that
let a test's upstream on loopback in, and the wait for a tool to be listed."""

from __future__ import annotations

import asyncio
from typing import Any

from stargrpc.server.grpc_server import StargrpcServer

#: ``mcp_servers_allowed_networks`` for an upstream on 127.0.0.1 (loopback is refused else).
LOOPBACK = ["127.0.0.0/8"]


async def tools_of(server: StargrpcServer, wanted: str, *, available: bool = True
                   ) -> dict[str, Any]:
    """Waits (on catalog changes, bounded) until ``wanted`` is listed as (un)available."""
    async def wait() -> dict[str, Any]:
        async for registry in server.runtime.catalog_updates():
            spec = registry.get(wanted)
            if spec is not None and spec.description.startswith("[unavailable") != available:
                return dict(registry)
        raise AssertionError("unreachable")

    return await asyncio.wait_for(wait(), 20)
