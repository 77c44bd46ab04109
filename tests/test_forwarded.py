"""The audit names the HTTP client of a gateway or MCP call (not the gateway's own loopback
hop), and no outside gRPC caller can make it name someone else."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import httpx
import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from stargrpc.forwarded import CLIENT_METADATA, VOUCHER_METADATA, ForwardedClient
from stargrpc.server.interceptors.audit import AuditInterceptor
from stargrpc.v1 import tool_service_pb2, tool_service_pb2_grpc
from tests.conftest import ServerFactory
from tests.gateway.conftest import gateway_registry
from tests.helpers import records_of

#: The HTTP clients of these tests connect from here: the gateway reaches its gRPC port from
#: 127.0.0.1, so the two are told apart.
CLIENT_ADDRESS = "127.0.0.2"

#: Whom the forged calls claim to be.
SOMEONE_ELSE = "ipv4:198.51.100.7"


async def test_http_calls_are_recorded_with_the_http_clients_address(
        make_server: ServerFactory) -> None:
    server = await make_server(registry=gateway_registry(), http_port=0, mcp_port=0)
    assert server.mcp is not None
    transport = httpx.AsyncHTTPTransport(local_address=CLIENT_ADDRESS)
    async with httpx.AsyncClient(transport=transport, timeout=30,
                                 base_url=f"http://127.0.0.1:{server.http.gateway_port}") as http:
        ran = await http.post("/v1/tools/echo:execute?wait=true",
                              json={"arguments": {"text": "over http"}})
        listed = await http.get("/v1/runs")
    assert ran.status_code == listed.status_code == 200
    async with httpx2.AsyncClient(transport=httpx2.AsyncHTTPTransport(
            local_address=CLIENT_ADDRESS), timeout=30) as mcp_http:
        url = f"http://127.0.0.1:{server.mcp.port}/mcp"
        async with Client(streamable_http_client(url, http_client=mcp_http),  # type: ignore[arg-type]
                          mode="legacy") as client:
            tools = await client.list_tools()
    assert any(tool.name == "echo" for tool in tools.tools)

    records = await records_of(server)
    by_method = {record.method.rsplit("/", 1)[1]: record.peer for record in records}
    assert {"Execute", "ListRuns", "ListTools"} <= by_method.keys()  # MCP: WatchCatalog too
    assert set(by_method.values()) == {"ipv4:127.0.0.2"}, by_method


async def test_an_outside_grpc_caller_cannot_name_another_client(
        make_server: ServerFactory) -> None:
    server = await make_server(registry=gateway_registry(), http_port=0)
    audit = next(i for i in server.interceptors if isinstance(i, AuditInterceptor))
    genuine = audit.forwarded.metadata(f"ipv4:{CLIENT_ADDRESS}")
    forgeries = {
        "x-forwarded-for": [("x-forwarded-for", "198.51.100.7")],
        "unvouched": [(CLIENT_METADATA, SOMEONE_ELSE)],
        "wrong voucher": [(CLIENT_METADATA, SOMEONE_ELSE), (VOUCHER_METADATA, "0" * 64)],
        # A voucher is for one address: it does not carry over to another.
        "another's voucher": [(CLIENT_METADATA, SOMEONE_ELSE), genuine[1]],
        "named twice": [*genuine, (CLIENT_METADATA, SOMEONE_ELSE)],
        "another server's voucher": ForwardedClient.of_this_process().metadata(SOMEONE_ELSE),
    }
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        for name, metadata in forgeries.items():
            request = tool_service_pb2.ExecuteRequest(
                tool_name="echo", arguments_json=json.dumps({"text": name}))
            events = [response.event async for response in stub.Execute(request,
                                                                      metadata=metadata)]
            assert events[-1].HasField("result")
        await stub.ListTools(tool_service_pb2.ListToolsRequest(),
                             metadata=forgeries["wrong voucher"])

    records = await records_of(server)
    peers = {record.arguments: record.peer for record in records
             if record.method.endswith("/Execute")}
    assert len(peers) == len(forgeries)
    assert all(peer.startswith("ipv4:127.0.0.1:") for peer in peers.values()), peers
    listed = [record.peer for record in records if record.method.endswith("/ListTools")]
    assert len(listed) == 1 and listed[0].startswith("ipv4:127.0.0.1:")


async def test_x_forwarded_for_names_the_client_only_from_a_trusted_proxy(
        make_server: ServerFactory, tmp_path: Path) -> None:
    claimed = {"X-Forwarded-For": "198.51.100.7"}
    peers = []
    for index, trusted in enumerate(("", "127.0.0.0/8")):
        server = await make_server(registry=gateway_registry(), http_port=0,
                                   http_trusted_proxies=trusted,
                                   state_dir=tmp_path / f"state-{index}")
        async with httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{server.http.gateway_port}", timeout=30) as http:
            assert (await http.get("/v1/runs", headers=claimed)).status_code == 200
        peers += [record.peer for record in await records_of(server)]

    # A local process is no proxy unless configured as one (uvicorn's default believes
    # 127.0.0.1).
    assert peers == ["ipv4:127.0.0.1", SOMEONE_ELSE]


def test_vouchers_are_the_same_for_every_process_of_a_server() -> None:
    secret = b"k" * 32
    one, other = ForwardedClient.from_secret(secret), ForwardedClient.from_secret(secret)
    stranger = ForwardedClient.from_secret(b"s" * 32)

    vouched = one.metadata("ipv6:[::1]")
    assert other.client_of(vouched) == "ipv6:[::1]"
    assert stranger.client_of(vouched) is None
    assert one.client_of([]) is None
