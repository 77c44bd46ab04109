"""The python tool through a real server: streaming, files, and abuse that must be contained."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.helpers import as_dict, run_tool
from tests.sandbox.proctable import marker, wait_until_gone, wait_until_running

#: Small limits keep the abuse tests quick. The wall clock is generous, so that on a busy
#: machine the CPU limit (1 s of CPU may take several seconds of real time) still comes first.
LIMITS = {"sandbox_cpu_seconds": 1, "sandbox_memory_mb": 256, "sandbox_file_size_mb": 16,
          "sandbox_max_processes": 32, "sandbox_wall_clock_seconds": 60,
          "sandbox_warm_pool": 1}


def tagged(code: str, token: str) -> str:
    """``code`` re-executed with ``token`` on its command line, so the test can find every
    process it spawns (forks inherit the command line) in the process table."""
    return (f"import os, sys\nif sys.argv[-1] != {token!r}:\n"
            f"    os.execv(sys.executable, [sys.executable, '-I', '-u', __file__, {token!r}])\n"
            + code)


@pytest.fixture
async def stub(make_server):
    server = await make_server(**LIMITS)
    # A warm pool of one: each test's first call takes the sandbox started ahead, so every
    # behaviour here is checked through the pool's hand-out as well as on demand.
    await server.warm_pool.filled()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield tool_service_pb2_grpc.ToolServiceStub(channel)


def deltas(events: list[events_pb2.RunEvent], channel: str) -> list[str]:
    return [e.step.delta for e in events
            if e.HasField("step") and e.step.phase == events_pb2.STEP_PHASE_DELTA
            and e.step.channel == channel]


async def test_prints_stream_as_stdout_deltas_then_one_result(stub) -> None:
    code = ("import os, sys\nfor i in range(1, 4):\n    print(i)\n"
            "print('careful', file=sys.stderr)\n"
            "open(os.path.join(os.environ['OUTPUT_DIR'], 'report.txt'), 'w').write('done')\n")
    events = await run_tool(stub, "python", {"code": code})

    kinds = [(e.WhichOneof("kind"), e.step.phase, e.step.step.id) for e in events]
    assert kinds[:2] == [("step", events_pb2.STEP_PHASE_START, "s0"),
                         ("step", events_pb2.STEP_PHASE_START, "s1")]
    assert kinds[-3:] == [("step", events_pb2.STEP_PHASE_END, "s1"),
                          ("step", events_pb2.STEP_PHASE_END, "s0"), ("result", 0, "")]
    assert all(k[2] == "s1" for k in kinds[2:-3])  # every delta belongs to the sandbox step
    assert "".join(deltas(events, "stdout")) == "1\n2\n3\n"
    assert all(d.endswith("\n") for d in deltas(events, "stdout"))  # whole lines
    assert "".join(deltas(events, "stderr")) == "careful\n"

    result = events[-1].result
    assert result.outcome == events_pb2.OUTCOME_OK
    assert result.output.startswith("1\n2\n3\n")
    assert as_dict(result)["structured_output"]["exit_status"] == 0
    [sent] = result.writeback.sent_files
    assert (sent.name, sent.content, sent.mime_type, sent.size) == (
        "report.txt", b"done", "text/plain", 4)


async def test_a_failing_snippet_fails_with_its_exit_status(stub) -> None:
    events = await run_tool(stub, "python", {"code": "raise SystemExit(3)"})

    result = events[-1].result
    assert result.outcome == events_pb2.OUTCOME_FAILED
    assert (result.error.code, result.error.message) == ("EXIT_STATUS", "exited with status 3")
    assert events[-3].step.step.status == events_pb2.STEP_STATUS_ERROR


ABUSE = {
    "memory bomb": ("x = bytearray(4 * 1024 ** 3)", "FAILED", "MEMORY_LIMIT",
                    "stopped: memory limit of 256 MB exceeded"),
    "fork bomb": ("while True:\n    os.fork()", "FAILED", "PROCESS_LIMIT",
                  "stopped: process limit of 32 reached (fork bomb?)"),
    "cpu spin": ("while True:\n    pass", "FAILED", "CPU_LIMIT",
                 "killed: CPU time limit of 1 s exceeded"),
    "10 GB write": ("with open('big', 'wb') as f:\n    for _ in range(10 * 1024):\n"
                    "        f.write(b'x' * 1024 * 1024)", "FAILED", "FILE_SIZE_LIMIT",
                    "stopped: file size limit of 16 MB exceeded"),
}


@pytest.mark.parametrize("case", list(ABUSE))
async def test_abuse_is_stopped_with_a_specific_reason_and_leaves_nothing(stub, case) -> None:
    code, outcome, reason_code, message = ABUSE[case]
    token = marker()
    events = await run_tool(stub, "python", {"code": tagged(code, token)})

    result = events[-1].result
    assert events_pb2.Outcome.Name(result.outcome) == f"OUTCOME_{outcome}"
    assert (result.error.code, result.error.message) == (reason_code, message)
    assert as_dict(result)["structured_output"]["verdict"] == reason_code
    assert await wait_until_gone(token) == []
    still = await run_tool(stub, "echo", {"text": "still serving"})
    assert still[-1].result.output == "still serving"


async def test_a_process_ignoring_sigterm_is_killed_at_the_wall_clock(make_server) -> None:
    server = await make_server(**{**LIMITS, "sandbox_wall_clock_seconds": 2})
    token = marker()
    code = tagged("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                  "time.sleep(600)", token)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        events = await run_tool(stub, "python", {"code": code})
        still = await run_tool(stub, "echo", {"text": "still serving"})

    result = events[-1].result
    assert result.outcome == events_pb2.OUTCOME_TIMEOUT
    assert (result.error.code, result.error.message) == (
        "WALL_CLOCK_LIMIT", "killed: wall-clock limit of 2 s exceeded")
    assert await wait_until_gone(token) == []
    assert still[-1].result.output == "still serving"


async def test_cancel_run_kills_the_snippet_and_its_children(stub) -> None:
    token = marker()
    code = tagged("import subprocess, time\nsubprocess.Popen([sys.executable, '-c', "
                  f"'import time; time.sleep(600)', {token!r}])\nprint('started')\n"
                  "time.sleep(600)", token)
    call = stub.Execute(tool_service_pb2.ExecuteRequest(
        tool_name="python", arguments_json=json.dumps({"code": code})))
    events = []
    async for response in call:
        events.append(response.event)
        if response.event.step.delta == "started\n":
            break
    assert len(await wait_until_running(token, count=2)) == 2

    reply = await stub.CancelRun(tool_service_pb2.CancelRunRequest(
        run_id=events[0].run_id, reason="test"))
    rest = [response.event async for response in call]

    assert reply.cancelled
    assert rest[-1].result.outcome == events_pb2.OUTCOME_CANCELLED
    assert await wait_until_gone(token) == []


async def test_server_shutdown_kills_running_snippets(make_server) -> None:
    server = await make_server(**LIMITS)
    token = marker()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        call = stub.Execute(tool_service_pb2.ExecuteRequest(
            tool_name="python", arguments_json=json.dumps(
                {"code": tagged("print('up')\nimport time\ntime.sleep(600)", token)})))
        async for response in call:
            if response.event.step.delta == "up\n":
                break
        await asyncio.wait_for(server.stop(grace=0.5), 30)
    assert await wait_until_gone(token) == []
