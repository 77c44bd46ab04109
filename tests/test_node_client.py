"""The contract from another language: the Node.js client in clients/node/ (grpc-js with
stubs loaded from protos/) against a real server, asserting the event sequences the Python
tests assert. Its npm dependencies are installed from the committed lock file when missing.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
from google.protobuf import json_format

from stargrpc.server import StargrpcServer
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.client.faults import Proxy, Recorder
from tests.client.test_aio import COUNT_TO_3, count_phases
from tests.helpers import phases, run_tool

NODE_DIR = Path(__file__).resolve().parent.parent / "clients" / "node"
TIMEOUT = 60



@pytest.fixture(scope="session")
def node_cli() -> list[str]:
    """``node clients/node/cli.js``, with its dependencies installed (``npm ci``)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.fail("the Node.js client test needs node and npm (apt-get install nodejs npm)")
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"],
                       cwd=NODE_DIR, check=True, timeout=600)
    return [node, str(NODE_DIR / "cli.js")]


async def _node(node_cli: list[str], *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        *node_cli, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), TIMEOUT)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def _events(lines: str) -> list[events_pb2.RunEvent]:
    """Node's JSON lines, read back as the contract's messages: any field Node decoded
    differently would fail here or in the comparisons."""
    return [json_format.ParseDict(json.loads(line), events_pb2.RunEvent())
            for line in lines.splitlines()]


async def test_node_lists_tools_and_streams_the_same_events_as_python(
        server: StargrpcServer, stub: tool_service_pb2_grpc.ToolServiceStub,
        node_cli: list[str]) -> None:
    target = f"127.0.0.1:{server.port}"

    code, out, _ = await _node(node_cli, "tools", "--json", "--target", target)
    assert code == 0
    catalog = json.loads(out)
    assert catalog["catalog_hash"] == server.runtime.registry.catalog_hash
    assert {"count", "echo", "sleep"} <= {t["name"] for t in catalog["tools"]}

    code, out, _ = await _node(node_cli, "call", "count", '{"to": 3}', "--json",
                               "--target", target)
    from_node = _events(out)
    from_python = await run_tool(stub, "count", {"to": 3})

    assert code == 0
    assert phases(from_node) == phases(from_python) == COUNT_TO_3
    assert [e.seq for e in from_node] == list(range(1, len(from_node) + 1))
    assert from_node[-1].result.output == from_python[-1].result.output == "counted to 3"

    code, _, err = await _node(node_cli, "call", "no_such_tool", "--target", target)
    assert code == 1 and "NOT_FOUND" in err


async def test_node_watch_replays_a_run_after_a_seq(
        server: StargrpcServer, stub: tool_service_pb2_grpc.ToolServiceStub,
        node_cli: list[str]) -> None:
    call = stub.Execute(tool_service_pb2.ExecuteRequest(
        tool_name="count", arguments_json='{"to": 4, "delay": 0.05}', idempotency_key="k1"))
    first = [(await call.read()).event, (await call.read()).event]

    code, out, _ = await _node(node_cli, "watch", first[0].run_id, "--after-seq", "2",
                               "--json", "--target", f"127.0.0.1:{server.port}")
    rest = []
    while (response := await call.read()) is not grpc.aio.EOF:
        rest.append(response.event)

    assert code == 0
    assert _events(out) == rest  # the very same events, field for field
    assert phases(first + rest) == count_phases(4)


async def test_node_resumes_a_broken_stream_through_watch_run(
        make_server, node_cli: list[str]) -> None:
    recorder = Recorder()
    server = await make_server(interceptors=[recorder])
    proxy = Proxy(server.port)
    await proxy.start()
    proc = await asyncio.create_subprocess_exec(
        *node_cli, "call", "count", '{"to": 6, "delay": 0.1}', "--json",
        "--target", proxy.target, stdout=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    try:
        lines = []
        while len(lines) < 2:
            lines.append(await asyncio.wait_for(proc.stdout.readline(), TIMEOUT))
        proxy.cut()  # the network fails mid-run; the server does not notice
        rest, _ = await asyncio.wait_for(proc.communicate(), TIMEOUT)
    finally:
        await proxy.close()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()

    events = _events(b"".join(lines).decode() + rest.decode())
    assert proc.returncode == 0
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert phases(events) == count_phases(6)
    assert len(recorder.seen("Execute")) == 1
    assert recorder.seen("WatchRun"), "the Node client resumed through WatchRun"


async def test_node_cli_usage_errors_are_clear_and_exit_two(node_cli: list[str]) -> None:
    code, out, _ = await _node(node_cli, "--help")
    assert code == 0
    assert out.startswith("usage: cli.js tools")

    code, _, err = await _node(node_cli, "--no-such-option")
    assert code == 2
    assert "Unknown option '--no-such-option'" in err and "usage:" in err

    code, _, err = await _node(node_cli, "call", "echo", '{"text": ')
    assert code == 2
    assert "ARGS_JSON is not valid JSON" in err


async def test_node_cli_ends_quietly_when_its_reader_stops_early(
        server: StargrpcServer, node_cli: list[str]) -> None:
    # As `… --json | head -1`: the reader closes the pipe after one line.
    read_end, write_end = os.pipe()
    proc = await asyncio.create_subprocess_exec(
        *node_cli, "call", "count", '{"to": 50, "delay": 0.02}', "--json",
        "--target", f"127.0.0.1:{server.port}", stdout=write_end,
        stderr=asyncio.subprocess.PIPE)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as reader:
        first = await asyncio.to_thread(reader.readline)
    _, err = await asyncio.wait_for(proc.communicate(), TIMEOUT)

    assert json.loads(first)["seq"] == "1"
    assert proc.returncode == 0
    assert err == b""
