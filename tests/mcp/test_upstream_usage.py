"""The receipt of a call to an MCP server's tool: the JSON of the call's parameters and of
its result, the only bytes of the shared connection that are the call's own."""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest

from stargrpc.v1 import events_pb2, tool_service_pb2_grpc
from tests.conftest import ServerFactory
from tests.helpers import run_tool
from tests.mcp.helpers import LOOPBACK, tools_of
from tests.mcp.upstream_server import Observed

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("quick_pings"),
              pytest.mark.filterwarnings("ignore:The logging capability is deprecated")]


async def test_a_call_counts_the_json_of_its_parameters_and_result(
        make_server: ServerFactory, http_upstream: tuple[str, Observed, Any]) -> None:
    url, _, _ = http_upstream
    server = await make_server(mcp_servers=[{"name": "up", "url": url, "roles": ["*"]}],
                               mcp_servers_allowed_networks=LOOPBACK)
    await tools_of(server, "up.progress")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        events = await run_tool(tool_service_pb2_grpc.ToolServiceStub(channel),
                                "up.progress", {"steps": 2})

    result = events[-1].result
    assert result.outcome == events_pb2.OUTCOME_OK, result
    sent = json.dumps({"name": "progress", "arguments": {"steps": 2}}, separators=(",", ":"))
    assert result.usage.network_bytes_sent == len(sent)
    # The result carries "counted to 2" twice (text and structured content) and more.
    assert result.usage.network_bytes_received > 2 * len("counted to 2")
    assert not result.usage.HasField("cpu_user_seconds")
