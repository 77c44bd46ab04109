"""MCP servers behind stargrpc (mcp_servers): servers written with the official SDK, one
over streamable HTTP in this process, one over stdio in the sandbox; their tools are
called over gRPC through the whole pipeline."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from mcp import Client as McpClient
from mcp.client.session import ClientSession
from structlog.testing import capture_logs

from stargrpc.client import Client
from stargrpc.errors import InvalidArgument
from stargrpc.mcp import upstream as upstream_module
from stargrpc.mcp.schemas import ArgumentChecker, schema_problem
from stargrpc.mcp.upstream import Upstream
from stargrpc.runs.arguments import validate
from stargrpc.server.grpc_server import StargrpcServer
from stargrpc.stores.memory import MemoryRunLog
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.conftest import AuthServerFactory, ServerFactory
from tests.helpers import eventually, key_channel, run_tool, status_details
from tests.mcp.helpers import LOOPBACK, tools_of
from tests.mcp.upstream_server import PNG, Observed, serve_http

# The SDK deprecates MCP logging for the 2026-07-28 revision; log messages still flow.
pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("quick_pings"),
              pytest.mark.filterwarnings("ignore:The logging capability is deprecated")]

REPO = Path(__file__).resolve().parents[2]


def result_of(events: list[events_pb2.RunEvent]) -> events_pb2.Result:
    assert events[-1].HasField("result")
    return events[-1].result


def only(server: StargrpcServer) -> Upstream:
    return server.upstreams.servers[0]


async def reason_says(server: StargrpcServer, text: str) -> Upstream:
    """Waits (bounded) until the server's only MCP server is unavailable for ``text``."""
    upstream = only(server)
    await eventually(lambda: text in upstream.reason, within=10, interval=0.05,
                     what=lambda: f"{text!r} in {upstream.reason!r}")
    return upstream


async def test_http_server_tools_join_the_catalog_and_run_through_the_pipeline(
        make_server: ServerFactory, http_upstream: tuple[str, Observed, Any]) -> None:
    url, observed, _ = http_upstream
    server = await make_server(mcp_servers=[{"name": "up", "url": url, "roles": ["*"]}],
                               mcp_servers_allowed_networks=LOOPBACK)
    before = server.runtime.registry.catalog_hash
    catalog = await tools_of(server, "up.progress")
    assert {"up.progress", "up.hang", "up.fail", "up.image"} <= set(catalog)
    assert "echo" in catalog  # the local tools stay
    assert server.runtime.registry.catalog_hash != before
    spec = catalog["up.progress"]
    assert spec.input_schema()["properties"]["steps"]["type"] == "integer"
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        listed = await stub.ListTools(tool_service_pb2.ListToolsRequest())
        assert "up.progress" in {tool.name for tool in listed.tools}
        events = await run_tool(stub, "up.progress", {"steps": 3})
        result = result_of(events)
        assert result.outcome == events_pb2.OUTCOME_OK, result
        assert result.output == "counted to 3"
        assert result.structured_output.struct_value["result"] == "counted to 3"
        beats = [e.heartbeat for e in events if e.HasField("heartbeat")]
        assert [b.progress for b in beats] == pytest.approx([1 / 3, 2 / 3, 1.0])
        assert beats[0].message == "step 1"
        deltas = "".join(e.step.delta for e in events if e.HasField("step"))
        assert "[info] did step 1" in deltas and "[info] did step 3" in deltas

        events = await run_tool(stub, "up.image", {})
        result = result_of(events)
        assert result.outcome == events_pb2.OUTCOME_OK
        [sent] = result.writeback.sent_files
        assert sent.mime_type == "image/png" and sent.content == PNG

        result = result_of(await run_tool(stub, "up.fail", {}))
        assert result.outcome == events_pb2.OUTCOME_FAILED
        assert result.error.code == "TOOL_FAILED"
        assert "failed on purpose" in result.output

        # Arguments are checked against the upstream schema before the server is called.
        calls = len(observed.calls)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await run_tool(stub, "up.progress", {"steps": "many"})
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        [bad] = [d for d in status_details(refused.value)
                 if isinstance(d, error_details_pb2.BadRequest)]
        # Named at its path, as a local tool's argument is (issue 29).
        [violation] = bad.field_violations
        assert violation.field == "arguments.steps"
        assert violation.description == "'many' is not of type 'integer'"
        assert len(observed.calls) == calls


@pytest.mark.parametrize("mode", ["legacy", "2026-07-28"])
async def test_an_idle_connection_stays_up_through_pings_in_either_protocol_era(
        make_server: ServerFactory, http_upstream: tuple[str, Observed, Any],
        monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    # A 2026-07-28 server answers ping with an error ("Method not found"): an answer all
    # the same, so the connection must stay (issue 29, item 1); a handshake-era one answers
    # it. Either way: pings go out, none ends the connection.
    url, _, _ = http_upstream
    monkeypatch.setattr(upstream_module, "Client", functools.partial(McpClient, mode=mode))
    pinged = asyncio.Event()
    answers: list[str] = []
    send_ping = ClientSession.send_ping

    async def counting(self: ClientSession, **kwargs: Any) -> Any:
        try:
            reply = await send_ping(self, **kwargs)
        except Exception as exc:
            answers.append(f"error: {exc}")
            raise
        else:
            answers.append("ok")
            return reply
        finally:
            if len(answers) >= 5:
                pinged.set()

    monkeypatch.setattr(ClientSession, "send_ping", counting)
    with capture_logs() as logs:
        server = await make_server(mcp_servers=[{"name": "up", "url": url}],
                                   mcp_servers_allowed_networks=LOOPBACK)
        await tools_of(server, "up.progress")
        await asyncio.wait_for(pinged.wait(), 20)
        upstream = only(server)
        assert upstream.available, upstream.reason
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = tool_service_pb2_grpc.ToolServiceStub(channel)
            result = result_of(await run_tool(stub, "up.progress", {"steps": 1}))
        assert result.outcome == events_pb2.OUTCOME_OK, result
    connected = [e for e in logs if e["event"] == "mcp_server_connected"]
    lost = [e for e in logs if e["event"] == "mcp_server_unavailable"]
    assert len(connected) == 1 and not lost, (connected, lost, answers)
    expected = "ok" if mode == "legacy" else "error: Method not found"
    assert answers[0].startswith(expected), answers


async def test_a_hung_call_is_stopped_by_the_critic_and_the_server_told(
        make_server: ServerFactory, http_upstream: tuple[str, Observed, Any]) -> None:
    url, observed, _ = http_upstream
    server = await make_server(
        mcp_servers=[{"name": "up", "url": url, "soft_timeout_seconds": 1.0}],
        mcp_servers_allowed_networks=LOOPBACK)
    await tools_of(server, "up.hang")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        result = result_of(await run_tool(stub, "up.hang", {}))
    assert result.outcome == events_pb2.OUTCOME_TIMEOUT
    assert result.error.code == "CRITIC_NO_PROGRESS"
    # notifications/cancelled reached the server: its handler was cancelled.
    await asyncio.wait_for(observed.cancelled.wait(), 10)


async def test_a_permission_is_refused_before_the_server_is_contacted(
        make_auth_server: AuthServerFactory, http_upstream: tuple[str, Observed, Any]) -> None:
    url, observed, _ = http_upstream
    auth = await make_auth_server(
        roles=("reader",),
        mcp_servers=[{"name": "up", "url": url, "roles": ["ops"], "principals": ["carol"]}],
        mcp_servers_allowed_networks=LOOPBACK)
    await tools_of(auth.server, "up.progress")
    async with key_channel(auth.target, auth.key) as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await run_tool(stub, "up.progress", {"steps": 1})
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert observed.calls == []
    async with key_channel(auth.target, auth.add_key("ops-user", "ops")) as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        result = result_of(await run_tool(stub, "up.progress", {"steps": 1}))
    assert result.outcome == events_pb2.OUTCOME_OK
    assert observed.calls == ["progress"]
    async with key_channel(auth.target, auth.add_key("carol", "nobody")) as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        result = result_of(await run_tool(stub, "up.progress", {"steps": 1}))
    assert result.outcome == events_pb2.OUTCOME_OK  # allowed by principal id


async def test_loopback_is_refused_unless_allowed(
        make_server: ServerFactory, http_upstream: tuple[str, Observed, Any]) -> None:
    url, observed, _ = http_upstream
    server = await make_server(mcp_servers=[{"name": "up", "url": url}])
    upstream = await reason_says(server, "ADDRESS_REFUSED")
    assert "127.0.0.1" in upstream.reason
    assert "up.progress" not in server.runtime.registry
    assert observed.calls == []
    # The rest of the catalog serves as usual.
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        result = result_of(await run_tool(stub, "echo", {"text": "still here"}))
    assert result.outcome == events_pb2.OUTCOME_OK


async def test_a_server_that_goes_away_is_marked_unavailable_and_comes_back(
        make_server: ServerFactory) -> None:
    async with serve_http() as (url, _, http):
        port = http.servers[0].sockets[0].getsockname()[1]
        server = await make_server(mcp_servers=[{"name": "up", "url": url,
                                                 "connect_timeout_seconds": 2}],
                                   mcp_servers_allowed_networks=LOOPBACK,
                                   mcp_servers_restart_max_seconds=0.3)
        await tools_of(server, "up.progress")
        available_hash = server.runtime.registry.catalog_hash
    catalog = await tools_of(server, "up.progress", available=False)
    assert "up.progress" in catalog
    assert server.runtime.registry.catalog_hash != available_hash
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        result = result_of(await run_tool(stub, "up.progress", {"steps": 1}))
        assert result.outcome == events_pb2.OUTCOME_FAILED
        assert result.error.code == "MCP_SERVER_UNAVAILABLE"
        assert "'up' is unavailable" in result.error.message
        async with serve_http(port):
            await tools_of(server, "up.progress")
            assert server.runtime.registry.catalog_hash == available_hash
            result = result_of(await run_tool(stub, "up.progress", {"steps": 1}))
            assert result.outcome == events_pb2.OUTCOME_OK


# -- stdio, in the sandbox -------------------------------------------------------------------


def stdio_entry(**extra: Any) -> dict[str, Any]:
    """The SDK server as a stdio command: the system's Python with this virtualenv's
    packages and the test script, both shown read-only inside bubblewrap."""
    packages = next(p for p in sys.path if p.startswith(sys.prefix)
                    and p.endswith("site-packages"))
    return {"name": "box", "command": "python3",
            "args": [str(Path(__file__).with_name("upstream_server.py"))],
            "env": {"PYTHONPATH": packages},
            "read_only_paths": [packages, str(Path(__file__).parent)], **extra}


@pytest.fixture
async def stdio_server(make_server: ServerFactory) -> StargrpcServer:
    if os.geteuid() != 0:
        pytest.skip("the sandbox's own user needs a root server")
    server = await make_server(mcp_servers=[stdio_entry()], sandbox_isolation="bwrap",
                               mcp_servers_restart_max_seconds=0.3)
    await tools_of(server, "box.progress")
    return server


def server_pid(server: StargrpcServer) -> int:
    """The pid of the stdio server's process group leader (the sandbox wrapper)."""
    process = only(server)._process
    assert process is not None
    return process.pid


async def test_stdio_server_runs_in_the_sandbox_and_is_restarted_after_a_crash(
        stdio_server: StargrpcServer) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stdio_server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        events = await run_tool(stub, "box.progress", {"steps": 2})
        result = result_of(events)
        assert result.outcome == events_pb2.OUTCOME_OK, result
        assert result.output == "counted to 2"
        assert any(e.heartbeat.progress == 1.0 for e in events if e.HasField("heartbeat"))
        first = server_pid(stdio_server)
        assert _uid_of(first) != 0  # runs as the sandbox's user, not as the server's

        result = result_of(await run_tool(stub, "box.crash", {}))
        assert result.outcome == events_pb2.OUTCOME_FAILED
        assert result.error.code == "MCP_SERVER_DIED"
        assert "'box' went away during the call" in result.error.message

        await tools_of(stdio_server, "box.progress")  # restarted (unavailable meanwhile)
        await eventually(lambda: only(stdio_server).available, within=10, interval=0.1,
                         what="the restarted MCP server available")
        result = result_of(await run_tool(stub, "box.progress", {"steps": 1}))
        assert result.outcome == events_pb2.OUTCOME_OK
        assert server_pid(stdio_server) != first


async def test_stdio_server_killed_mid_call_ends_the_run_with_a_clear_result(
        stdio_server: StargrpcServer) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stdio_server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        request = tool_service_pb2.ExecuteRequest(tool_name="box.hang", arguments_json="{}")
        events: list[events_pb2.RunEvent] = []
        async for response in stub.Execute(request):
            events.append(response.event)
            if len(events) == 1:  # the run has started: the call is on its way
                # The call is sent right after the start.
                await eventually(lambda: only(stdio_server)._calls, within=5,
                                 what="the call sent to the MCP server")
                os.killpg(server_pid(stdio_server), signal.SIGKILL)
    result = result_of(events)
    assert result.outcome == events_pb2.OUTCOME_FAILED
    assert result.error.code == "MCP_SERVER_DIED"


def _uid_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError("no Uid line")


async def test_a_tool_that_does_not_say_it_is_harmless_is_destructive_for_approval(
        make_server: ServerFactory, http_upstream: tuple[str, Observed, Any]) -> None:
    # MCP's destructiveHint defaults to true, but a tool without annotations was taken as
    # not destructive: approval_policy's destructive let every such tool run unapproved.
    url, _, _ = http_upstream
    server = await make_server(mcp_servers=[{"name": "up", "url": url, "roles": ["*"]}],
                               mcp_servers_allowed_networks=LOOPBACK,
                               approval_policy={"destructive": True})
    await tools_of(server, "up.peek")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        listed = await stub.ListTools(tool_service_pb2.ListToolsRequest())
    tools = {tool.name: tool for tool in listed.tools}
    assert {name: (tools[name].annotations.destructive, tools[name].requires_approval)
            for name in ("up.progress", "up.peek", "up.append")} == {
        "up.progress": (True, True),  # says nothing: may destroy
        "up.peek": (False, False),  # read-only
        "up.append": (False, False)}  # says its updates are only additive


async def test_a_server_that_never_answers_does_not_block_the_catalog(
        make_server: ServerFactory) -> None:
    accepted: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)  # reads nothing, answers nothing

    listener = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        server = await make_server(
            mcp_servers=[{"name": "slow", "url": f"http://127.0.0.1:{port}/mcp",
                          "connect_timeout_seconds": 0.5}],
            mcp_servers_allowed_networks=LOOPBACK)
        # Serving started without waiting for it; the local tools answer meanwhile.
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = tool_service_pb2_grpc.ToolServiceStub(channel)
            result = result_of(await run_tool(stub, "echo", {"text": "hi"}))
        assert result.outcome == events_pb2.OUTCOME_OK
        await reason_says(server, "no answer within 0.5 s (connect_timeout_seconds)")
        assert accepted  # it was tried
    finally:
        for writer in accepted:
            writer.close()
        listener.close()


# -- a hostile server (issue 25) -------------------------------------------------------------

#: What a gRPC client accepts by default, stargrpc's Client included.
DEFAULT_RECEIVE_BYTES = 4 * 1024 * 1024


async def hostile_server(make_server: ServerFactory, url: str) -> StargrpcServer:
    """A stargrpc server with the hostile MCP server as ``up``, once its tools are listed."""
    server = await make_server(mcp_servers=[{"name": "up", "url": url, "roles": ["*"]}],
                               mcp_servers_allowed_networks=LOOPBACK)
    await tools_of(server, "up.fine")
    return server


async def still_serving(server: StargrpcServer) -> None:
    """The catalog fits a default client and reads with stargrpc's Client; a local tool and
    an ordinary tool of the hostile server run."""
    target = f"127.0.0.1:{server.port}"
    async with grpc.aio.insecure_channel(target) as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        listed = await stub.ListTools(tool_service_pb2.ListToolsRequest())
        assert listed.ByteSize() < DEFAULT_RECEIVE_BYTES
        watched = await anext(aiter(stub.WatchCatalog(tool_service_pb2.WatchCatalogRequest())))
        assert watched.ByteSize() < DEFAULT_RECEIVE_BYTES
        for tool, arguments in (("echo", {"text": "hi"}), ("up.fine", {"text": "hi"})):
            result = result_of(await run_tool(stub, tool, arguments))
            assert result.outcome == events_pb2.OUTCOME_OK, (tool, result)

    def read_catalog() -> set[str]:
        with Client(target) as client:
            return {tool.name for tool in client.list_tools().tools}

    names = await asyncio.to_thread(read_catalog)
    assert {"echo", "up.fine"} <= names


async def test_what_a_server_lists_is_bounded_and_the_catalog_fits_a_default_client(
        make_server: ServerFactory) -> None:
    with capture_logs() as logs:
        async with serve_http(hostile=True, bulk=300) as (url, _, _):
            server = await hostile_server(make_server, url)
            catalog = server.runtime.registry
            # A 6 MiB description is trimmed, and the log names the server and the tool.
            assert len(catalog["up.huge"].description) <= upstream_module.MAX_DESCRIPTION_CHARS
            assert catalog["up.huge"].description.startswith("A tool. xxx")
            # 310 listed: the first 256 kept.
            ours = [name for name in catalog if name.startswith("up.")]
            assert len(ours) <= upstream_module.MAX_TOOLS_PER_SERVER
            assert "up.bulk_245" in catalog and "up.bulk_246" not in catalog
            # 80 tools of 60 KiB schemas would make 5 MB: the catalog keeps what fits of
            # them beside every smaller tool.
            big = [n for n in catalog if "up.bulk_000" <= n < "up.bulk_080"]
            assert 30 < len(big) < 80
            assert "up.bulk_079" not in catalog
            await still_serving(server)
    events = {(line["event"], line.get("server"), line.get("tool")) for line in logs}
    assert ("mcp_tool_description_trimmed", "up", "huge") in events
    assert ("mcp_tools_left_out", "up", None) in events
    assert ("mcp_tool_left_out", None, "up.bulk_079") in events


async def test_a_tool_whose_schema_cannot_be_used_is_listed_unavailable_with_the_reason(
        make_server: ServerFactory) -> None:
    async with serve_http(hostile=True) as (url, observed, _):
        server = await hostile_server(make_server, url)
        catalog = server.runtime.registry
        reasons = {
            "up.self_ref": "loop of references that never moves into the arguments",
            "up.deep": "levels (limit 32)",
            "up.remote_ref": "refers to 'http://169.254.169.254/latest/schema.json', "
                             "which it does not hold",
            "up.bad_pattern": "has a pattern that is not a regular expression: '(unclosed'",
        }
        for name, reason in reasons.items():
            description = catalog[name].description
            assert description.startswith("[unavailable: its input schema "), description
            assert reason in description, description
        assert not catalog["up.tree"].description.startswith("[unavailable")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = tool_service_pb2_grpc.ToolServiceStub(channel)
            # The schema of issue 25, called with {}: a Result, not UNKNOWN RecursionError.
            result = result_of(await run_tool(stub, "up.self_ref", {}))
            assert result.outcome == events_pb2.OUTCOME_FAILED
            assert result.error.code == "MCP_TOOL_UNAVAILABLE"
            assert "loop of references" in result.error.message
            # A recursive schema over deep but finite arguments: checked, then called.
            tree: dict[str, Any] = {}
            for _ in range(31):  # 63 levels: under the 64 of max_argument_depth
                tree = {"children": [tree]}
            result = result_of(await run_tool(stub, "up.tree", tree))
            assert result.outcome == events_pb2.OUTCOME_OK, result
            # 30 references at each of 40 levels: refused as too costly, never RecursionError.
            nested: dict[str, Any] = {}
            for _ in range(40):
                nested = {"x": nested}
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await run_tool(stub, "up.costly", nested)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            [bad] = [d for d in status_details(refused.value)
                     if isinstance(d, error_details_pb2.BadRequest)]
            assert "too costly to check against the tool's input schema" \
                in bad.field_violations[0].description
        assert observed.calls == ["anything"]  # only tree reached the server
        await still_serving(server)


async def test_a_flood_of_progress_becomes_a_bounded_number_of_heartbeats(
        make_server: ServerFactory) -> None:
    count = 20_000
    async with serve_http(hostile=True) as (url, _, _):
        server = await hostile_server(make_server, url)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = tool_service_pb2_grpc.ToolServiceStub(channel)
            events = await run_tool(stub, "up.flood", {"count": count})
        result = result_of(events)
        assert result.outcome == events_pb2.OUTCOME_OK, result
        assert result.output == f"flooded {count}"
        beats = [e.heartbeat for e in events if e.HasField("heartbeat")]
        # Today's bound: the burst, one per interval of the call, the last. 20,000 before.
        assert 1 < len(beats) < 400, len(beats)
        assert beats[0].message == "step 1" and beats[-1].message == f"step {count}"
        assert beats[-1].progress == 1.0
        [notice] = [e.notice for e in events if e.HasField("notice")]
        assert notice.code == "MCP_PROGRESS_COALESCED"
        assert f"sent {count} progress notifications: {len(beats)} became heartbeats" \
            in notice.message
        # What the run keeps: a few hundred events and kilobytes, not 20,000 and a megabyte.
        log = server.runtime.store.get(events[0].run_id)
        assert isinstance(log, MemoryRunLog)
        assert log.last_seq < 400
        assert log.size < 64 * 1024, log.size
        await still_serving(server)


async def test_a_flood_of_log_messages_keeps_a_bounded_share_of_them(
        make_server: ServerFactory) -> None:
    # 3,000 log messages of 1 KB: the run keeps the first MiB of them as its log output and
    # counts the rest, where it kept every one (the server's memory grew with them).
    count, size = 3_000, 1_000
    async with serve_http(hostile=True) as (url, _, _):
        server = await hostile_server(make_server, url)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = tool_service_pb2_grpc.ToolServiceStub(channel)
            events = await run_tool(stub, "up.chatter", {"count": count, "size": size})
        result = result_of(events)
        assert result.outcome == events_pb2.OUTCOME_OK, result
        logged = [e.step.delta for e in events
                  if e.HasField("step") and e.step.channel == "log"]
        kept = sum(len(text.encode()) for text in logged)
        assert 0 < kept <= upstream_module.MAX_LOG_BYTES_PER_CALL
        assert logged[0].startswith("[info] 000000 ")
        [notice] = [e.notice for e in events if e.HasField("notice")]
        assert notice.code == "MCP_LOG_TRUNCATED"
        assert f"the {count - len(logged)} notifications after them" in notice.message
        await still_serving(server)


def test_a_schema_the_validator_cannot_apply_refuses_the_arguments_with_its_reason() -> None:
    # Past the checks made at listing (an ``items`` that is no schema): the call is refused
    # INVALID_ARGUMENT with the reason, as every argument error is.
    schema = {"type": "object", "properties": {"a": {"items": 5}}}
    assert schema_problem(schema) is None
    model = upstream_module._schema_model("up.odd", schema, ArgumentChecker(schema))
    with pytest.raises(InvalidArgument) as refused:
        validate(model, {"a": [1]})
    [violation] = refused.value.violations
    assert violation.field == "arguments"
    assert "the tool's input schema cannot check them (AttributeError" in violation.description
    assert validate(model, {"a": "not a list"}).model_extra == {"a": "not a list"}


# -- bodies an HTTP server sends ---------------------------------------------------------------

#: What the raw server's ``bomb`` tool answers: a JSON-RPC result whose text is this many
#: bytes, gzipped (some 17 KiB on the wire) or plain.
BOMB_BYTES = upstream_module.MAX_LINE_BYTES + 1024


async def _raw_mcp_server(gzip_bomb: bool = False, listings: list[int] | None = None
                          ) -> asyncio.Server:
    """A streamable-HTTP MCP server written by hand (no SDK, so it may break the rules):
    it answers initialize, lists ``fine``, ``bomb`` and ``flood`` (each tools/list counted
    in ``listings``), answers ``bomb`` with a body of BOMB_BYTES, gzipped (``gzip_bomb``:
    although the client asked for no compression) or plain (over the one-message bound),
    and ``flood`` with an event stream of ``count`` tools/list_changed notifications before
    its result."""
    import json
    import zlib

    def reply(writer: asyncio.StreamWriter, body: bytes, extra: bytes = b"") -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n" + extra
                     + b"content-length: %d\r\n\r\n" % len(body) + body)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while request_line := await reader.readline():
                headers = {}
                while (line := await reader.readline()) not in (b"\r\n", b""):
                    name, _, value = line.decode().partition(":")
                    headers[name.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                if not request_line.startswith(b"POST"):
                    writer.write(b"HTTP/1.1 405 No\r\ncontent-length: 0\r\n\r\n")
                    continue
                message = json.loads(body)
                if "id" not in message:
                    writer.write(b"HTTP/1.1 202 Accepted\r\ncontent-length: 0\r\n\r\n")
                    continue
                method, params = message["method"], message.get("params") or {}
                if method == "tools/list" and listings is not None:
                    listings.append(1)
                if method == "tools/call" and params["name"] == "flood":
                    changed = b"data: %s\n\n" % json.dumps(
                        {"jsonrpc": "2.0", "method": "notifications/tools/list_changed"}
                    ).encode()
                    events = changed * params["arguments"]["count"] + b"data: %s\n\n" % (
                        json.dumps({"jsonrpc": "2.0", "id": message["id"], "result": {
                            "content": [{"type": "text", "text": "flooded"}]}}).encode())
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                 b"content-length: %d\r\n\r\n" % len(events) + events)
                    await writer.drain()
                    continue
                if method == "tools/call" and params["name"] == "bomb":
                    text = json.dumps({"jsonrpc": "2.0", "id": message["id"], "result": {
                        "content": [{"type": "text", "text": "a" * BOMB_BYTES}]}}).encode()
                    if gzip_bomb:
                        packer = zlib.compressobj(9, zlib.DEFLATED, 31)
                        reply(writer, packer.compress(text) + packer.flush(),
                              b"content-encoding: gzip\r\n")
                    else:
                        reply(writer, text)
                    await writer.drain()
                    continue
                result: dict[str, Any] | None = {
                    "initialize": {"protocolVersion": params.get("protocolVersion"),
                                   "capabilities": {"tools": {}},
                                   "serverInfo": {"name": "raw", "version": "1"}},
                    "tools/list": {"tools": [
                        {"name": name, "inputSchema": {"type": "object"}}
                        for name in ("fine", "bomb", "flood")]},
                    "tools/call": {"content": [{"type": "text", "text": "fine: hi"}]},
                    "ping": {},
                }.get(method)
                answer = ({"result": result} if result is not None else
                          {"error": {"code": -32601, "message": "Method not found"}})
                reply(writer, json.dumps({"jsonrpc": "2.0", "id": message["id"],
                                          **answer}).encode())
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


@pytest.mark.parametrize("gzip_bomb", [True, False], ids=["gzip-bomb", "oversized"])
async def test_a_compressed_or_oversized_answer_fails_the_call_unread(
        make_server: ServerFactory, gzip_bomb: bool) -> None:
    # A 17 KiB gzip body of 16 MiB was inflated whole in memory (a few MiB of it, to
    # gigabytes), and a plain JSON body was read however long it went on.
    listener = await _raw_mcp_server(gzip_bomb)
    port = listener.sockets[0].getsockname()[1]
    try:
        server = await hostile_server(make_server, f"http://127.0.0.1:{port}/mcp")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = tool_service_pb2_grpc.ToolServiceStub(channel)
            result = result_of(await run_tool(stub, "up.bomb", {}))
            assert result.outcome == events_pb2.OUTCOME_FAILED, result.error
            assert result.error.code == "MCP_ERROR"
            assert (("compressed body (Content-Encoding: gzip)" if gzip_bomb else
                     f"JSON response is over {upstream_module.MAX_LINE_BYTES} bytes")
                    in result.error.message), result.error.message
            assert not result.output
            # The connection stays: the next call is answered.
            result = result_of(await run_tool(stub, "up.fine", {}))
            assert result.outcome == events_pb2.OUTCOME_OK and result.output == "fine: hi"
        assert only(server).available
    finally:
        listener.close()


async def test_a_flood_of_list_changed_notifications_lists_the_tools_a_few_times(
        make_server: ServerFactory) -> None:
    # Each notification listed and vetted the tools at once: 300 of them, 300 listings in
    # parallel (thousands slowed every other call for minutes).
    listings: list[int] = []
    listener = await _raw_mcp_server(listings=listings)
    port = listener.sockets[0].getsockname()[1]
    try:
        server = await hostile_server(make_server, f"http://127.0.0.1:{port}/mcp")
        upstream = only(server)
        assert len(listings) == 1
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = tool_service_pb2_grpc.ToolServiceStub(channel)
            result = result_of(await run_tool(stub, "up.flood", {"count": 300}))
            assert result.outcome == events_pb2.OUTCOME_OK and result.output == "flooded"
            # Listed again (at least once, for the notifications), then quiet.
            await eventually(lambda: len(listings) >= 2
                             and not getattr(upstream, "_relisting", False),
                             within=10, what="the tools listed again")
            assert len(listings) <= 3, len(listings)
            result = result_of(await run_tool(stub, "up.fine", {}))
            assert result.outcome == events_pb2.OUTCOME_OK
        assert upstream.available
    finally:
        listener.close()
