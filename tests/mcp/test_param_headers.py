"""A 2026-07-28 ``tools/call``'s ``Mcp-Param-*`` headers are checked against the tool's
``x-mcp-header`` annotations — also for a tool whose schemas the endpoint keeps from an
earlier listing, and after the catalog changed under it — while a call of a tool without
annotations makes no listing of its own."""

from __future__ import annotations

import json
import textwrap
from typing import Any

import httpx2
from mcp_types.jsonrpc import HEADER_MISMATCH

from stargrpc.server.interceptors.audit import AuditInterceptor
from tests.mcp.conftest import McpUnderTest

#: The tool of the extra tools folder, its ``region`` plain or annotated.
ROUTE = textwrap.dedent('''
    from pydantic import BaseModel, Field
    from stargrpc import tool

    class A(BaseModel):
        region: str = Field(EXTRA)

    @tool()
    async def route(ctx, args: A) -> str:
        """Route to a region."""
        return f"routed to {args.region}"
''')


def _install_route(mcp_server: McpUnderTest, tmp_path: Any, *, annotated: bool) -> None:
    extra = 'json_schema_extra={"x-mcp-header": "Region"}' if annotated else 'description="Where."'
    (tmp_path / "extra_tools" / "route.py").write_text(ROUTE.replace("EXTRA", extra))
    mcp_server.auth.server.reload_tools()


async def _call(mcp_server: McpUnderTest, tool: str, arguments: dict[str, Any],
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    """One 2026-07-28 ``tools/call`` as a client posts it; the HTTP status and the
    JSON-RPC answer."""
    meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientInfo": {"name": "test", "version": "1"},
            "io.modelcontextprotocol/clientCapabilities": {}}
    body = {"jsonrpc": "2.0", "id": 7, "method": "tools/call",
            "params": {"name": tool, "arguments": arguments, "_meta": meta}}
    async with httpx2.AsyncClient(timeout=30) as http:
        reply = await http.post(mcp_server.url, content=json.dumps(body), headers={
            "Authorization": f"Bearer {mcp_server.auth.key}",
            "Content-Type": "application/json",
            "Accept": "application/json, text/event-stream",
            "MCP-Protocol-Version": "2026-07-28", "Mcp-Method": "tools/call",
            "Mcp-Name": tool, **(headers or {})})
    if reply.headers["content-type"].startswith("text/event-stream"):
        frames = [line[len("data: "):] for line in reply.text.splitlines()
                  if line.startswith("data: ")]
        return reply.status_code, json.loads(frames[-1])
    return reply.status_code, reply.json()


async def _list_tools_records(mcp_server: McpUnderTest) -> int:
    audit = next(i for i in mcp_server.auth.server.interceptors
                 if isinstance(i, AuditInterceptor))
    await audit.writer.flush()
    return len([r async for r in audit.writer.store.scan()
                if r.method.endswith("/ListTools")])


def _text(answer: dict[str, Any]) -> str:
    assert "result" in answer, answer
    return str(answer["result"]["content"][0]["text"])


async def test_an_annotated_argument_needs_its_matching_header(
        mcp_server: McpUnderTest, tmp_path: Any) -> None:
    _install_route(mcp_server, tmp_path, annotated=True)

    missing = await _call(mcp_server, "route", {"region": "eu"})
    wrong = await _call(mcp_server, "route", {"region": "eu"}, {"Mcp-Param-Region": "us"})
    right = await _call(mcp_server, "route", {"region": "eu"}, {"Mcp-Param-Region": "eu"})

    assert missing[0] == 400 and missing[1]["error"]["code"] == HEADER_MISMATCH
    assert "missing" in missing[1]["error"]["message"]
    assert wrong[0] == 400 and wrong[1]["error"]["code"] == HEADER_MISMATCH
    assert right[0] == 200 and _text(right[1]) == "routed to eu"
    # Checked on every call, not only the first.
    again = await _call(mcp_server, "route", {"region": "eu"}, {"Mcp-Param-Region": "us"})
    assert again[0] == 400 and again[1]["error"]["code"] == HEADER_MISMATCH


async def test_a_tool_without_annotations_is_called_without_a_listing(
        mcp_server: McpUnderTest, tmp_path: Any) -> None:
    _install_route(mcp_server, tmp_path, annotated=False)
    first = await _call(mcp_server, "route", {"region": "eu"})  # learns the schemas
    listed = await _list_tools_records(mcp_server)

    answers = [await _call(mcp_server, "route", {"region": r}) for r in ("eu", "us", "ap")]

    assert _text(first[1]) == "routed to eu"
    assert [_text(a) for _, a in answers] == ["routed to eu", "routed to us", "routed to ap"]
    assert await _list_tools_records(mcp_server) == listed


async def test_a_tool_annotated_after_its_schema_was_kept_is_checked(
        mcp_server: McpUnderTest, tmp_path: Any) -> None:
    _install_route(mcp_server, tmp_path, annotated=False)
    assert _text((await _call(mcp_server, "route", {"region": "eu"}))[1]) == "routed to eu"

    _install_route(mcp_server, tmp_path, annotated=True)  # the catalog changes
    missing = await _call(mcp_server, "route", {"region": "eu"})
    right = await _call(mcp_server, "route", {"region": "eu"}, {"Mcp-Param-Region": "eu"})

    assert missing[0] == 400 and missing[1]["error"]["code"] == HEADER_MISMATCH
    assert right[0] == 200 and _text(right[1]) == "routed to eu"


async def test_a_changed_catalog_does_not_fail_a_call_that_still_fits(
        mcp_server: McpUnderTest, tmp_path: Any) -> None:
    _install_route(mcp_server, tmp_path, annotated=False)
    assert _text((await _call(mcp_server, "route", {"region": "eu"}))[1]) == "routed to eu"
    (tmp_path / "extra_tools" / "other.py").write_text(
        ROUTE.replace("route", "other").replace("EXTRA", 'description="Where."'))
    mcp_server.auth.server.reload_tools()

    status, answer = await _call(mcp_server, "route", {"region": "us"})

    assert status == 200 and _text(answer) == "routed to us"
    assert answer["result"].get("isError") is not True
