"""What the bridge knows of the catalog between calls: each tool's input schema and whether
it lists an output schema, as of one catalog hash.

The 2026-07-28 transport has a server check a ``tools/call``'s ``Mcp-Param-*`` headers
against the ``x-mcp-header`` annotations of the tool's input schema, as the caller was
advertised it. The SDK does so by running the server's whole ``tools/list`` before every
call — for stargrpc a second gRPC call (ListTools, authenticated and audited) and the whole
catalog turned into MCP tools, every time: about a third of the endpoint's latency.

A tool's schemas are the same for every caller under one catalog hash (only permissions
differ), so the bridge keeps them from every listing it makes. A call of a tool known to
have no ``x-mcp-header`` annotation cannot fail the check whatever the caller may see, so
it skips the listing and pins its Execute to the hash the schema was learnt under
(``catalog_hash``: a changed catalog refuses it, CATALOG_STALE, before the run starts, and
the bridge then checks the headers the SDK's way and calls again). A tool with annotations,
or not known yet, is checked the SDK's way: against this caller's listing.
"""

from __future__ import annotations

import json

import mcp_types as types
from mcp.shared.inbound import MCP_PARAM_HEADER_PREFIX, X_MCP_HEADER_KEY

from stargrpc.v1 import tool_service_pb2

#: Lower-cased (ASGI header names are).
PARAM_HEADER_PREFIX = MCP_PARAM_HEADER_PREFIX.lower()


class CatalogSchemas:
    """The schemas of the tools listed under the latest catalog hash the bridge has seen.

    Attributes:
        catalog_hash: The hash they were listed under ("" before the first listing).
    """

    catalog_hash: str
    _annotated: dict[str, bool]
    _output_schemas: dict[str, bool]

    def __init__(self) -> None:
        self.catalog_hash = ""
        self._annotated = {}
        self._output_schemas = {}

    def learn(self, reply: tool_service_pb2.ListToolsResponse,
              tools: list[types.Tool]) -> None:
        """Keeps the schemas of a listing (``tools``: ``reply``'s tools as MCP tools); a
        listing under another hash replaces what was known."""
        if reply.catalog_hash != self.catalog_hash:
            self.catalog_hash = reply.catalog_hash
            self._annotated, self._output_schemas = {}, {}
        for tool in tools:
            # Conservative: the key anywhere in the schema counts as an annotation.
            self._annotated[tool.name] = X_MCP_HEADER_KEY in json.dumps(tool.input_schema)
            self._output_schemas[tool.name] = tool.output_schema is not None

    def without_param_headers(self, tool_name: str) -> bool:
        """Whether ``tool_name`` is known (under :attr:`catalog_hash`) to declare no
        ``x-mcp-header``: no ``Mcp-Param-*`` header check can fail for it."""
        return self._annotated.get(tool_name) is False

    def declares_output_schema(self, tool_name: str) -> bool | None:
        """Whether ``tool_name`` lists an output schema; None when it is not known."""
        return self._output_schemas.get(tool_name)
