"""What an MCP client gets from a tool (issue 29): the output text as the tool gave it, whole
up to MAX_TEXT_CHARS and beyond it its beginning and a link to the whole text (a resource
the caller reads with its own credentials), structuredContent only for the tool's own
structured result, facts about the run in _meta — for sandboxed, bundled and custom tools
alike, consistent with what gRPC gets."""

from __future__ import annotations

import mcp_types as types
import pytest
from mcp.shared.exceptions import MCPError

from stargrpc.mcp.mapping import (
    MAX_TEXT_CHARS,
    OUTPUT_META_KEY,
    STRUCTURED_META_KEY,
    output_uri,
)
from stargrpc.v1 import events_pb2, tool_service_pb2_grpc
from tests.conftest import AuthServerFactory
from tests.helpers import key_channel, run_tool
from tests.mcp.conftest import MODES, McpUnderTest
from tests.mcp.mcp_tools import long_text, mcp_registry

pytestmark = pytest.mark.timeout(90)

#: The snippet of the issue: 300,004 bytes printed (the last line's newline included).
PRINTS = 'print("x" * 300_000 + "END")'


def texts(result: types.CallToolResult) -> list[str]:
    return [block.text for block in result.content if isinstance(block, types.TextContent)]


def links(result: types.CallToolResult) -> list[types.ResourceLink]:
    return [block for block in result.content if isinstance(block, types.ResourceLink)]


async def read_all(client, uri: str) -> str:  # type: ignore[no-untyped-def]
    read = await client.read_resource(uri)
    [contents] = read.contents
    assert isinstance(contents, types.TextResourceContents)
    assert contents.uri == uri and contents.mime_type == "text/plain"
    return contents.text


@pytest.mark.parametrize("mode", MODES)
async def test_a_long_python_output_shows_its_beginning_and_links_to_all_of_it(
        mcp_server: McpUnderTest, mode: str) -> None:
    async with mcp_server.client(mode=mode) as client:
        result = await client.call_tool("python", {"code": PRINTS})
        assert not result.is_error, result
        assert result.meta is not None
        run_id = result.meta["stargrpc.dev/run-id"]
        [text] = texts(result)
        [link] = links(result)
        whole = await read_all(client, link.uri)

    # The beginning, as printed (no tail, no "…"), and a line that says what is left out.
    printed = "x" * 300_000 + "END"
    assert text.startswith("x" * MAX_TEXT_CHARS + "\n[output truncated: these are the first "
                           f"{MAX_TEXT_CHARS} of {len(whole)} characters")
    assert link.uri == output_uri(run_id) and link.uri in text
    assert link.mime_type == "text/plain" and link.size == len(whole.encode())
    assert result.meta[OUTPUT_META_KEY] == {"uri": link.uri, "chars": len(whole),
                                            "shown_chars": MAX_TEXT_CHARS}
    # All of it, as gRPC's Result.output has it: what it printed, then the verdict.
    assert whole == printed + "\n[exited with status 0]"
    # The sandbox's verdict is about the run: _meta, never what a model is handed instead.
    assert result.structured_content is None
    facts = result.meta[STRUCTURED_META_KEY]
    assert (facts["exit_status"], facts["verdict"], facts["output_truncated"]) == (0, "OK",
                                                                                 False)


async def test_grpc_output_of_a_sandboxed_tool_is_all_it_printed_as_the_deltas_carried(
        mcp_server: McpUnderTest) -> None:
    code = PRINTS + '\nimport sys; print("warned", file=sys.stderr); sys.exit(3)'
    async with key_channel(mcp_server.auth.target, mcp_server.auth.key) as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        events = await run_tool(stub, "python", {"code": code})
    result = events[-1].result
    stdout = "".join(e.step.delta for e in events
                     if e.HasField("step") and e.step.channel == "stdout")
    stderr = "".join(e.step.delta for e in events
                     if e.HasField("step") and e.step.channel == "stderr")
    assert stdout == "x" * 300_000 + "END\n" and stderr == "warned\n"
    assert result.outcome == events_pb2.OUTCOME_FAILED
    assert result.output == f"{stdout.rstrip()}\n[stderr]\nwarned\n[exited with status 3]"
    assert result.structured_output.struct_value["exit_status"] == 3


async def test_a_short_output_is_whole_with_no_link(mcp_server: McpUnderTest) -> None:
    async with mcp_server.client() as client:
        result = await client.call_tool("python", {"code": 'print("hi")'})
        exact = await client.call_tool("long_text", {"chars": MAX_TEXT_CHARS})
    assert texts(result) == ["hi\n[exited with status 0]"]
    assert not links(result) and result.meta is not None
    assert OUTPUT_META_KEY not in result.meta
    assert texts(exact) == [long_text(MAX_TEXT_CHARS)] and not links(exact)


async def test_structured_content_only_for_the_tools_own_structured_result(
        mcp_server: McpUnderTest) -> None:
    async with mcp_server.client() as client:
        await client.list_tools()
        declared = await client.call_tool("measure", {"size": 2})
        beside = await client.call_tool("facts", {})
        as_json = await client.call_tool("data", {})
        fetched_failed = await client.call_tool("count", {"to": 2})
    # An output schema: structuredContent, as MCP requires.
    assert declared.structured_content == {"x": 2, "y": 4}
    # Facts beside a text: the model reads the text; the facts are _meta.
    assert texts(beside) == ["the answer is 42"]
    assert beside.structured_content is None and beside.meta is not None
    assert beside.meta[STRUCTURED_META_KEY] == {"took_ms": 5, "cached": False}
    # Data whose text is that data as JSON: the two agree, so both are sent.
    assert as_json.structured_content == {"a": 1, "b": [1, 2.5], "c": "three"}
    assert as_json.meta is not None and STRUCTURED_META_KEY not in as_json.meta
    assert fetched_failed.structured_content is None


async def test_the_output_resource_is_the_callers_own(mcp_server: McpUnderTest) -> None:
    async with mcp_server.client() as client:
        result = await client.call_tool("long_text", {"chars": MAX_TEXT_CHARS + 5})
        [link] = links(result)
        assert await read_all(client, link.uri) == long_text(MAX_TEXT_CHARS + 5)
        templates = await client.list_resource_templates()
        assert [t.uri_template for t in templates.resource_templates] == [
            "stargrpc://runs/{run}/output"]
        with pytest.raises(MCPError) as unknown:
            await client.read_resource(output_uri("0" * 32))
        assert unknown.value.error.code == types.INVALID_PARAMS
    # Another principal (not an admin) is answered as for a run that does not exist.
    other = mcp_server.auth.add_key("other", "reader")
    async with mcp_server.client(key=other) as client:
        with pytest.raises(MCPError) as refused:
            await client.read_resource(link.uri)
    assert refused.value.error.code == types.INVALID_PARAMS
    assert "Unknown resource" in refused.value.error.message


async def test_an_output_too_large_for_the_result_is_whole_through_the_link(
        make_auth_server: AuthServerFactory) -> None:
    # A 64 KiB send limit: the Result keeps the output's beginning and the whole text
    # travels as the sent file output.txt; MCP shows it once, never as a second copy.
    small = McpUnderTest(await make_auth_server(mcp_registry(), mcp_port=0,
                                                max_send_message_bytes=64 * 1024,
                                                file_chunk_bytes=16 * 1024))
    chars = MAX_TEXT_CHARS + 20_000
    async with small.client() as client:
        result = await client.call_tool("long_text", {"chars": chars})
        [text] = texts(result)
        [link] = links(result)
        whole = await read_all(client, link.uri)
    assert whole == long_text(chars)
    assert text.startswith(long_text(chars)[:MAX_TEXT_CHARS] + "\n[output truncated")
    assert not [b for b in result.content if isinstance(b, types.EmbeddedResource)]
