"""SteerRun through a real server: steering reaching an async tool, a sync tool and a
sandboxed python snippet, replayed by WatchRun; who may steer; and the bad input that must
be refused without touching anything else."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2

from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.helpers import phases, status_details
from tests.runs_support import (
    HeaderPrincipal,
    as_principal,
    collect,
    execute_request,
    key,
    run_registry,
)

ALICE = as_principal("alice")
BOB = as_principal("bob")
ADMIN = as_principal("root", "admin")
WATCHER = as_principal("ui", "watch")
CRITIC = as_principal("judge", "critic")


@pytest.fixture
async def stub(make_server) -> tool_service_pb2_grpc.ToolServiceStub:
    server = await make_server(registry=run_registry(), interceptors=[HeaderPrincipal()],
                               steer_max_pending=3, steer_max_bytes=64,
                               sandbox_wall_clock_seconds=60)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    yield tool_service_pb2_grpc.ToolServiceStub(channel)
    await channel.close()


async def read_until(call, text: str) -> list[events_pb2.RunEvent]:
    """Reads an Execute stream up to the first delta holding ``text`` (bounded)."""
    seen = []
    async with asyncio.timeout(30):
        while (response := await call.read()) is not grpc.aio.EOF:
            seen.append(response.event)
            if response.event.step.delta and text in response.event.step.delta:
                return seen
    raise AssertionError(f"the stream ended before {text!r}: {phases(seen)}")


def steer(stub, run_id: str, message: str, metadata=ALICE):
    return stub.SteerRun(tool_service_pb2.SteerRunRequest(run_id=run_id, message=message),
                         metadata=metadata)


def steered_notices(events: list[events_pb2.RunEvent]) -> list[tuple[str, str]]:
    return [(e.notice.message, e.notice.source) for e in events
            if e.HasField("notice") and e.notice.code == "STEERED"]


def reason(error: grpc.aio.AioRpcError) -> str:
    return next(d.reason for d in status_details(error)
                if isinstance(d, error_details_pb2.ErrorInfo))


@pytest.mark.parametrize("tool_name", ["listen", "listen_sync"])
async def test_steering_reaches_the_tool_and_is_replayed_by_watch_run(stub, tool_name) -> None:
    call = stub.Execute(execute_request(tool_name, {"count": 2}), metadata=ALICE)
    head = await read_until(call, "listening")
    run_id = head[0].run_id

    await steer(stub, run_id, "try the other file")
    await steer(stub, run_id, "and be brief", metadata=CRITIC)
    events = head + await collect(call)

    assert events[-1].result.outcome == events_pb2.OUTCOME_OK
    assert events[-1].result.output == "try the other file | and be brief"
    assert steered_notices(events) == [("try the other file", "principal alice"),
                                       ("and be brief", "principal judge")]
    # Each notice comes before what the tool did with its message.
    deltas = [e.step.delta for e in events if e.step.delta or e.HasField("notice")]
    notice_at = [i for i, e in enumerate(events) if e.HasField("notice")]
    echo_at = [i for i, e in enumerate(events) if e.step.delta.startswith("steered:")]
    assert notice_at[0] < echo_at[0] and notice_at[1] < echo_at[1], deltas
    replayed = await collect(stub.WatchRun(tool_service_pb2.WatchRunRequest(run_id=run_id),
                                           metadata=WATCHER))
    assert steered_notices(replayed) == steered_notices(events)


async def test_steering_reaches_a_sandboxed_python_snippet(stub) -> None:
    code = ("import json, os, time\n"
            "print('ready', flush=True)\n"
            "path = os.environ['STEER_FILE']\n"
            "deadline = time.monotonic() + 30\n"
            "while time.monotonic() < deadline:\n"
            "    lines = open(path).read().splitlines()\n"
            "    if lines:\n"
            "        print('got', json.loads(lines[0])['message'])\n"
            "        break\n"
            "    time.sleep(0.05)\n")
    call = stub.Execute(execute_request("python", {"code": code}), metadata=ALICE)
    head = await read_until(call, "ready")

    await steer(stub, head[0].run_id, "stop after the first line ✓")
    events = head + await collect(call)

    assert events[-1].result.outcome == events_pb2.OUTCOME_OK, events[-1].result
    assert "got stop after the first line ✓" in events[-1].result.output
    assert steered_notices(events) == [("stop after the first line ✓", "principal alice")]


async def test_a_snippet_that_replaces_its_steer_file_only_loses_its_steering(
        stub, tmp_path: Path) -> None:
    # The file named by $STEER_FILE is swapped for a symlink to a file outside the
    # sandbox's reach and for a FIFO: the server keeps writing to the file it created.
    victim = tmp_path / "victim"
    victim.write_text("")
    code = ("import os\n"
            "path = os.environ['STEER_FILE']\n"
            "os.unlink(path)\n"
            f"os.symlink({str(victim)!r}, path)\n"
            "print('ready', flush=True)\n"
            "import time; time.sleep(1)\n")
    call = stub.Execute(execute_request("python", {"code": code}), metadata=ALICE)
    head = await read_until(call, "ready")
    await steer(stub, head[0].run_id, "hello")
    events = head + await collect(call)

    assert events[-1].result.outcome == events_pb2.OUTCOME_OK, events[-1].result
    assert victim.read_text() == ""


async def test_bad_steering_is_refused_and_the_run_goes_on(stub, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    call = stub.Execute(execute_request(
        "tally", {"path": str(tmp_path / "tally"), "deltas": 1, "gate": str(gate)},
        idempotency_key=key()), metadata=ALICE)
    head = await read_until(call, "0")
    run_id = head[0].run_id

    refusals = {}
    for name, message, metadata in [
        ("unknown", ("0" * 32, "hi"), ALICE),
        ("not yours", (run_id, "hi"), BOB),
        ("watcher", (run_id, "hi"), WATCHER),
        ("too large", (run_id, "x" * 65), ALICE),
        ("empty", (run_id, "  "), ALICE),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await steer(stub, *message, metadata=metadata)
        refusals[name] = (refused.value.code(), reason(refused.value))
    # A flood: the run holds at most steer_max_pending unread messages.
    for i in range(3):
        await steer(stub, run_id, f"m{i}")
    with pytest.raises(grpc.aio.AioRpcError) as flooded:
        await steer(stub, run_id, "one too many", metadata=ADMIN)
    retry = [d for d in status_details(flooded.value)
             if isinstance(d, error_details_pb2.RetryInfo)]

    assert refusals == {
        "unknown": (grpc.StatusCode.NOT_FOUND, "RUN_NOT_FOUND"),
        "not yours": (grpc.StatusCode.NOT_FOUND, "RUN_NOT_FOUND"),
        "watcher": (grpc.StatusCode.PERMISSION_DENIED, "STEER_NOT_ALLOWED"),
        "too large": (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT"),
        "empty": (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT"),
    }
    assert flooded.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert reason(flooded.value) == "STEER_QUEUE_FULL" and retry
    too_large = await _refusal(steer(stub, run_id, "x" * 65))
    violations = [d for d in status_details(too_large)
                  if isinstance(d, error_details_pb2.BadRequest)]
    assert violations[0].field_violations[0].field == "message"

    gate.write_text("")
    events = head + await collect(call)
    assert events[-1].result.outcome == events_pb2.OUTCOME_OK
    assert [m for m, _ in steered_notices(events)] == ["m0", "m1", "m2"]
    with pytest.raises(grpc.aio.AioRpcError) as finished:
        await steer(stub, run_id, "too late")
    assert finished.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert reason(finished.value) == "RUN_FINISHED"
    # The server still serves.
    assert phases(await collect(stub.Execute(execute_request("echo", {"text": "hi"}),
                                              metadata=ALICE)))[-1] == "RESULT OK"


async def _refusal(call) -> grpc.aio.AioRpcError:
    try:
        await call
    except grpc.aio.AioRpcError as error:
        return error
    raise AssertionError("not refused")


async def test_the_sdk_steers(stub, make_server) -> None:
    from stargrpc.client import AsyncClient

    server = await make_server(registry=run_registry())
    async with AsyncClient.connect(f"127.0.0.1:{server.port}") as client:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        local = tool_service_pb2_grpc.ToolServiceStub(channel)
        call = local.Execute(execute_request("listen", {"count": 1}))
        head = await read_until(call, "listening")
        await client.steer(head[0].run_id, "from the SDK")
        events = head + await collect(call)
        await channel.close()

    assert events[-1].result.output == "from the SDK"
