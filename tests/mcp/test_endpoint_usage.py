"""The run's receipt through the MCP endpoint: ``_meta["stargrpc.dev/usage"]`` of a
``CallToolResult`` holds its measured figures, as numbers."""

from __future__ import annotations

import pytest

from stargrpc.mcp.mapping import USAGE_META_KEY
from tests.mcp.conftest import MODES, McpUnderTest


@pytest.mark.parametrize("mode", MODES)
async def test_a_call_result_carries_the_receipt(mcp_server: McpUnderTest, mode: str) -> None:
    async with mcp_server.client(mode=mode) as client:
        result = await client.call_tool("measure", {"size": 3})

    assert result.meta is not None
    usage = result.meta[USAGE_META_KEY]
    assert isinstance(usage["wall_seconds"], float) and usage["wall_seconds"] > 0
    assert usage["queued_seconds"] == 0 and usage["child_runs"] == 0
    assert "cpu_user_seconds" not in usage  # an in-process tool: not measured
