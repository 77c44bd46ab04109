"""The server from a shell: the real grpcurl binary, the stargrpc CLI, and pytest-grpc's
fixtures pointed at a real server process."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from stargrpc.server.grpc_server import StargrpcServer
from stargrpc.v1 import tool_service_pb2, tool_service_pb2_grpc
from tests.procs import ServerProcess, serve

GRPCURL = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")
SERVICE = "stargrpc.v1.ToolService"


async def _run(*argv: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def _stargrpc(*args: str) -> list[str]:
    return [sys.executable, "-m", "stargrpc.cli", *args]


async def test_grpcurl_lists_and_describes(server: StargrpcServer) -> None:
    target = f"127.0.0.1:{server.port}"

    code, out, _ = await _run(GRPCURL, "-plaintext", target, "list")
    assert code == 0
    assert {SERVICE, "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection"} <= set(out.split())

    code, out, _ = await _run(GRPCURL, "-plaintext", target, "describe", SERVICE)
    assert code == 0
    assert ("rpc Execute ( .stargrpc.v1.ExecuteRequest ) "
            "returns ( stream .stargrpc.v1.ExecuteResponse )") in out
    assert "rpc WatchRun" in out and "rpc CancelRun" in out


async def test_grpcurl_execute_streams_events_as_they_happen(server: StargrpcServer) -> None:
    target = f"127.0.0.1:{server.port}"
    request = json.dumps({"tool_name": "count", "arguments": {"to": 3, "delay": 0.5}})
    proc = await asyncio.create_subprocess_exec(
        GRPCURL, "-plaintext", "-d", request, target, f"{SERVICE}/Execute",
        stdout=asyncio.subprocess.PIPE)
    assert proc.stdout is not None

    first = await asyncio.wait_for(proc.stdout.readline(), 30)
    assert first.strip() == b"{"
    assert proc.returncode is None  # the first event arrived while the run was still going
    rest, _ = await asyncio.wait_for(proc.communicate(), 30)
    messages = json.loads("[" + (first + rest).decode().replace("}\n{", "},\n{") + "]")

    events = [m["event"] for m in messages]
    assert [int(e["seq"]) for e in events] == list(range(1, len(events) + 1))
    assert events[0]["step"]["phase"] == "STEP_PHASE_START"
    assert [e["step"]["delta"] for e in events if e.get("step", {}).get("delta")] == [
        "1\n", "2\n", "3\n"]
    assert events[-2]["step"]["phase"] == "STEP_PHASE_END"
    assert events[-1]["result"]["outcome"] == "OUTCOME_OK"
    assert proc.returncode == 0


async def test_grpcurl_error_shows_status_and_details(server: StargrpcServer) -> None:
    target = f"127.0.0.1:{server.port}"
    request = json.dumps({"tool_name": "count", "arguments": {"to": "many"}})

    code, _, err = await _run(GRPCURL, "-plaintext", "-d", request, target,
                              f"{SERVICE}/Execute")

    assert code != 0
    assert "InvalidArgument" in err
    assert "arguments.to" in err
    assert "google.rpc.BadRequest" in err


async def test_cli_tools_and_call(server: StargrpcServer) -> None:
    target = f"127.0.0.1:{server.port}"

    code, out, _ = await _run(*_stargrpc("tools", "--target", target))
    assert code == 0
    assert "count" in out and "echo" in out

    code, out, _ = await _run(*_stargrpc("call", "--target", target, "echo", "--args",
                                         '{"text": "hello"}'))
    assert code == 0
    assert "hello" in out and "OK" in out

    code, out, _ = await _run(*_stargrpc("call", "--target", target, "count", "--args",
                                         '{"to": 2}', "--json"))
    assert code == 0
    lines = [json.loads(line) for line in out.splitlines()]
    assert [int(line["seq"]) for line in lines] == list(range(1, len(lines) + 1))
    assert lines[-1]["result"]["outcome"] == "OUTCOME_OK"


async def test_cli_health(server: StargrpcServer) -> None:
    code, out, _ = await _run(*_stargrpc("health", "--target", f"127.0.0.1:{server.port}"))
    assert (code, out.strip()) == (0, "SERVING")
    await server.stop(grace=0)
    code, _, err = await _run(*_stargrpc("health", "--target", f"127.0.0.1:{server.port}"))
    assert code == 1
    assert "unhealthy" in err


async def test_cli_call_renders_live_and_exits_nonzero_unless_ok(server: StargrpcServer
                                                                 ) -> None:
    target = f"127.0.0.1:{server.port}"
    proc = await asyncio.create_subprocess_exec(
        *_stargrpc("call", "--target", target, "count", "--args", '{"to": 3, "delay": 0.5}'),
        stdout=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    first = await asyncio.wait_for(proc.stdout.readline(), 30)
    assert b"count" in first
    assert proc.returncode is None  # rendered before the run ended
    await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0

    code, _, err = await _run(*_stargrpc("call", "--target", target, "no_such_tool"))
    assert code != 0
    assert "NOT_FOUND" in err
    code, _, err = await _run(*_stargrpc("call", "--target", target, "count", "--args", "[1]"))
    assert code != 0


# pytest-grpc's fixtures (grpc_addr, grpc_server, grpc_stub_cls, grpc_channel, grpc_stub),
# pointed at a real server process instead of the in-process server the plugin would start.


@pytest.fixture(scope="module")
def real_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with serve(tmp_path_factory.mktemp("pytest-grpc")) as process:
        yield process


@pytest.fixture(scope="module")
def grpc_addr(real_server: ServerProcess) -> str:
    return real_server.target


@pytest.fixture(scope="module")
def grpc_server(real_server: ServerProcess) -> ServerProcess:
    return real_server


@pytest.fixture(scope="module")
def grpc_stub_cls() -> type[tool_service_pb2_grpc.ToolServiceStub]:
    return tool_service_pb2_grpc.ToolServiceStub


def test_pytest_grpc_stub_talks_to_the_real_server(grpc_stub) -> None:
    reply = grpc_stub.ListTools(tool_service_pb2.ListToolsRequest(), timeout=30)
    assert {"count", "echo", "sleep"} <= {t.name for t in reply.tools}

    events = [r.event for r in grpc_stub.Execute(tool_service_pb2.ExecuteRequest(
        tool_name="echo", arguments_json='{"text": "sync"}'), timeout=30)]
    assert events[-1].result.output == "sync"
