"""Sessions through a real server and real sandboxes: state that persists, caps, ownership,
and code that tries to break out of its session."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.helpers import as_dict, eventually, key_channel, run_tool, status_details

#: Small limits keep the abuse tests quick.
LIMITS = {"sandbox_max_processes": 32, "sandbox_wall_clock_seconds": 30,
          "session_cpu_seconds": 20, "session_memory_mb": 256, "session_disk_mb": 16,
          "session_max_per_principal": 3, "session_max_total": 5}


@pytest.fixture
async def auth(make_auth_server):
    return await make_auth_server(roles=("admin",), **LIMITS)


@pytest.fixture
async def stub(auth):
    async with key_channel(auth.target, auth.key) as channel:
        yield tool_service_pb2_grpc.ToolServiceStub(channel)


async def create(stub, kind: str = "python", **fields) -> str:
    reply = await stub.CreateSession(tool_service_pb2.CreateSessionRequest(kind=kind, **fields))
    return reply.session.session_id


async def python(stub, session_id: str, code: str, **fields) -> events_pb2.Result:
    events = await run_tool(stub, "python", {"code": code}, session_id=session_id, **fields)
    return events[-1].result


def reason(error: grpc.aio.AioRpcError) -> str:
    return next(d.reason for d in status_details(error) if hasattr(d, "reason"))


async def test_a_python_session_keeps_its_interpreter_and_files(stub) -> None:
    session_id = await create(stub)

    first = await python(stub, session_id,
                         "import json\nrows = [1, 2, 3]\n"
                         "open('data.txt', 'w').write('kept')\nprint('loaded')")
    assert first.outcome == events_pb2.OUTCOME_OK, first
    assert first.output == "loaded"
    second = await python(stub, session_id,
                          "def total(xs):\n    return sum(xs)\n"
                          "{'total': total(rows), 'file': open('data.txt').read(), "
                          "'json': json.dumps(rows)}")
    assert second.outcome == events_pb2.OUTCOME_OK, second
    assert as_dict(second)["structured_output"] == {"total": 6, "file": "kept",
                                                    "json": "[1, 2, 3]"}
    third = await python(stub, session_id, "class Thing: pass\nThing()")
    assert as_dict(third)["structured_output"].startswith("<__main__.Thing object")


async def test_each_call_streams_its_output_as_deltas(stub) -> None:
    session_id = await create(stub)
    events = await run_tool(stub, "python", {"code": "import sys\nfor i in range(3):\n"
                                             "    print(i)\nprint('oops', file=sys.stderr)"},
                            session_id=session_id)
    out = "".join(e.step.delta for e in events if e.HasField("step")
                  and e.step.phase == events_pb2.STEP_PHASE_DELTA
                  and e.step.channel == "stdout")
    err = "".join(e.step.delta for e in events if e.HasField("step")
                  and e.step.phase == events_pb2.STEP_PHASE_DELTA
                  and e.step.channel == "stderr")
    assert (out, err) == ("0\n1\n2\n", "oops\n")
    assert events[-1].result.output == "0\n1\n2\n[stderr]\noops"


async def test_an_exception_fails_the_call_and_the_session_lives_on(stub) -> None:
    session_id = await create(stub)
    await python(stub, session_id, "x = 41")
    failed = await python(stub, session_id, "x += 1\n1 / 0")
    assert failed.outcome == events_pb2.OUTCOME_FAILED
    assert (failed.error.code, failed.error.message) == (
        "PYTHON_EXCEPTION", "ZeroDivisionError: division by zero")
    assert "Traceback" in failed.output
    after = await python(stub, session_id, "x")
    assert as_dict(after)["structured_output"] == 42
