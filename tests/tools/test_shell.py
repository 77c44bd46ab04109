"""The shell tool through a real server: privileged, streams, secrets stay out."""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2

from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.helpers import run_tool, status_details

LIMITS = {"sandbox_cpu_seconds": 2, "sandbox_memory_mb": 256, "sandbox_file_size_mb": 16,
          "sandbox_wall_clock_seconds": 10, "sandbox_warm_pool": 1}


@pytest.fixture
async def stub(make_server, monkeypatch):
    # A secret in the server's own environment, which no sandboxed command may see.
    monkeypatch.setenv("STARGRPC_TEST_DB_PASSWORD", "hunter2-secret")
    server = await make_server(**LIMITS)
    # A warm pool of one: each test's first call takes the sandbox started ahead, so every
    # behaviour here is checked through the pool's hand-out as well as on demand.
    await server.warm_pool.filled()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield tool_service_pb2_grpc.ToolServiceStub(channel)


async def test_shell_is_listed_as_privileged(stub) -> None:
    reply = await stub.ListTools(tool_service_pb2.ListToolsRequest())
    tools = {t.name: t for t in reply.tools}

    assert tools["shell"].permissions.privileged
    assert not tools["python"].permissions.privileged
    assert {"python", "shell", "http_fetch", "knowledge_search"} <= set(tools)


async def test_runs_a_command_line_streaming_both_channels(stub) -> None:
    events = await run_tool(stub, "shell", {
        "command": "echo out1; echo err1 >&2; echo out2; echo data > $OUTPUT_DIR/d.txt"})

    stdout = [e.step.delta for e in events if e.step.channel == "stdout"]
    stderr = [e.step.delta for e in events if e.step.channel == "stderr"]
    assert "".join(stdout) == "out1\nout2\n"
    assert stderr == ["err1\n"]
    assert events[-1].result.outcome == events_pb2.OUTCOME_OK
    assert [f.name for f in events[-1].result.writeback.sent_files] == ["d.txt"]


async def test_the_server_environment_is_not_visible(stub) -> None:
    events = await run_tool(stub, "shell", {
        "command": "env; cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'; true"})

    shown = "".join(e.step.delta for e in events) + events[-1].result.output
    assert "PATH=" in shown
    assert "hunter2-secret" not in shown


async def test_a_command_with_a_nul_byte_is_refused_before_the_run(stub) -> None:
    # Once an internal error (TOOL_EXCEPTION, a traceback in the log) as the command
    # started: no argument of a program can hold a NUL byte.
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await run_tool(stub, "shell", {"command": "echo 'a\0b'"})

    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    [violation] = [v for d in status_details(caught.value)
                   if isinstance(d, error_details_pb2.BadRequest) for v in d.field_violations]
    assert violation.field == "arguments.command"
    assert "NUL byte" in violation.description
    events = await run_tool(stub, "shell", {"command": "echo still serving"})
    assert events[-1].result.output.startswith("still serving\n")


async def test_a_10_gb_write_stops_at_the_file_size_limit(stub) -> None:
    events = await run_tool(stub, "shell", {"command": "head -c 10G /dev/zero > big"})

    result = events[-1].result
    assert result.outcome == events_pb2.OUTCOME_FAILED
    assert result.error.message == "stopped: file size limit of 16 MB exceeded"
