"""MCP, the Model Context Protocol, both ways: stargrpc's tools served to MCP clients, and
the tools of MCP servers (``mcp_servers``) served as stargrpc's.

- :mod:`stargrpc.mcp.bridge`: MCP requests as ToolService calls (one pipeline for all).
- :mod:`stargrpc.mcp.mapping`: proto tools, events and Results as MCP types.
- :mod:`stargrpc.mcp.server`: the streamable-HTTP endpoint of a server (``--mcp-port``).
- :mod:`stargrpc.mcp.sessions`: its door: every request authenticated, each session its
  principal's, and how many each principal may hold.
- :mod:`stargrpc.mcp.stdio`: the same bridge over stdio (``stargrpc mcp-stdio``).
- :mod:`stargrpc.mcp.upstream`: MCP servers behind stargrpc, their tools in the catalog,
  bounded (count, description, schema size and depth) and kept up (health, reconnects).
- :mod:`stargrpc.mcp.schemas`: an upstream tool's input schema vetted when it is listed, and
  its arguments checked with bounded depth and work.
"""

from __future__ import annotations

from stargrpc.mcp.bridge import Bridge
from stargrpc.mcp.mapping import IDEMPOTENCY_META_KEY

__all__ = ["IDEMPOTENCY_META_KEY", "Bridge"]
