"""ListTools, the not-modified path, stale hashes, and WatchCatalog across a reload."""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2

from stargrpc.v1 import tool_service_pb2, tool_service_pb2_grpc
from tests.helpers import run_tool, status_details


async def test_list_tools_describes_each_tool(stub) -> None:
    reply = await stub.ListTools(tool_service_pb2.ListToolsRequest())

    tools = {t.name: t for t in reply.tools}
    assert {"count", "echo", "sleep"} <= set(tools)
    count = tools["count"]
    assert count.description.startswith("Count from 1")
    assert count.input_schema["properties"]["to"]["type"] == "integer"
    assert count.kind == "demo"
    assert count.annotations.read_only
    assert count.permissions.callable
    assert reply.catalog_hash.startswith("sha256:")
    assert not reply.not_modified


async def test_known_hash_gets_not_modified_without_payload(stub) -> None:
    first = await stub.ListTools(tool_service_pb2.ListToolsRequest())

    again = await stub.ListTools(
        tool_service_pb2.ListToolsRequest(known_catalog_hash=first.catalog_hash))

    assert again.not_modified
    assert len(again.tools) == 0
    assert again.catalog_hash == first.catalog_hash


async def test_stale_catalog_hash_is_refused_with_catalog_stale(stub) -> None:
    current = (await stub.ListTools(tool_service_pb2.ListToolsRequest())).catalog_hash

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await run_tool(stub, "echo", {"text": "x"}, catalog_hash="sha256:old")

    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    info = next(d for d in status_details(caught.value)
            if isinstance(d, error_details_pb2.ErrorInfo))
    assert info.reason == "CATALOG_STALE"
    assert info.metadata["current_catalog_hash"] == current
    events = await run_tool(stub, "echo", {"text": "x"}, catalog_hash=current)
    assert events[-1].result.output == "x"


async def test_watch_catalog_sends_current_then_each_change(make_server, tmp_path: Path
                                                           ) -> None:
    extra = tmp_path / "extra_tools"
    extra.mkdir()
    server = await make_server(tools_dir=[extra])
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        watch = stub.WatchCatalog(tool_service_pb2.WatchCatalogRequest())
        first = await asyncio.wait_for(watch.read(), 10)
        assert "greet" not in {t.name for t in first.tools}

        (extra / "greet.py").write_text(textwrap.dedent('''
            from pydantic import BaseModel
            from stargrpc import tool

            class A(BaseModel):
                name: str

            @tool()
            async def greet(ctx, args: A) -> str:
                """Greet someone."""
                return f"hello {args.name}"
        '''))
        server.reload_tools()  # what SIGHUP does

        second = await asyncio.wait_for(watch.read(), 10)
        assert "greet" in {t.name for t in second.tools}
        assert second.catalog_hash != first.catalog_hash
        watch.cancel()
        events = await run_tool(stub, "greet", {"name": "ada"})
        assert events[-1].result.output == "hello ada"


async def test_broken_reload_keeps_the_current_catalog(make_server, tmp_path: Path) -> None:
    extra = tmp_path / "extra_tools"
    extra.mkdir()
    server = await make_server(tools_dir=[extra])
    before = server.runtime.registry.catalog_hash
    (extra / "broken.py").write_text("raise ImportError('half-written file')\n")

    server.reload_tools()

    assert server.runtime.registry.catalog_hash == before
