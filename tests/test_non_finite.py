"""NaN and infinities in what a tool hands back: a protobuf Value takes them as numbers but
no JSON form of it can be written, so a Result holding one once broke every reader (the
audit record, the gateway, the clients). They come back spelt as proto3 JSON spells a
double's: "NaN", "Infinity", "-Infinity"."""

from __future__ import annotations

import json
from typing import Any

import grpc
from pydantic import BaseModel

from stargrpc import ToolContext, tool
from stargrpc.registry import Registry, load_registry, spec_of
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.helpers import as_dict, run_tool
from tests.sessions.session_helpers import create, python

NAN, INF = float("nan"), float("inf")
SPELT = {"x": "NaN", "y": ["Infinity", "-Infinity", 1.5]}


class Nothing(BaseModel):
    pass


@tool(kind="test")
async def not_finite(ctx: ToolContext, args: Nothing) -> dict[str, Any]:
    """Hands back NaN and infinities in its structured output, a rich message and a step."""
    ctx.send_rich_message("chart", {"x": NAN, "y": [INF, -INF, 1.5]})
    async with ctx.step("plotting", detail={"x": NAN, "y": [INF, -INF, 1.5]}):
        pass
    return {"x": NAN, "y": [INF, -INF, 1.5]}


async def test_a_tool_handing_back_nan_and_infinities_ends_with_a_readable_result(
        make_server) -> None:
    spec = spec_of(not_finite)
    assert spec is not None
    server = await make_server(registry=Registry([*load_registry().values(), spec]))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        events = await run_tool(stub, "not_finite", {})

        result = events[-1].result
        assert result.outcome == events_pb2.OUTCOME_OK
        assert as_dict(result)["structured_output"] == SPELT
        [rich] = as_dict(result)["writeback"]["sent_rich_messages"]
        assert rich["payload"] == SPELT
        [detail] = [as_dict(e)["step"]["step"]["detail"] for e in events
                    if e.HasField("step") and e.step.step.HasField("detail")][:1]
        assert detail == SPELT
        json.dumps(as_dict(result), allow_nan=False)  # strict JSON all through
        reply = await stub.ListTools(tool_service_pb2.ListToolsRequest())
        assert "not_finite" in {t.name for t in reply.tools}


async def test_a_session_kernel_that_reports_nan_does_not_break_the_call(make_server) -> None:
    # The session's code may speak for its own kernel (documented): its "done" frame is
    # untrusted input, and a value holding NaN once failed the Execute call.
    server = await make_server()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        session_id = await create(stub)
        forged = ("import gc\n"
                  "kernel = next(o for o in gc.get_objects() if type(o).__name__ == 'Kernel')\n"
                  "kernel.send({'t': 'done', 'call': kernel.current, 'ok': True, 'repr': 'r',"
                  " 'value': {'x': float('nan'), 'y': [float('inf'), -float('inf'), 1.5]}})\n"
                  "import time\ntime.sleep(1)\n")
        result = await python(stub, session_id, forged)

        assert result.outcome == events_pb2.OUTCOME_OK, result
        assert as_dict(result)["structured_output"] == SPELT
        after = await python(stub, session_id, "6 * 7")
        assert as_dict(after)["structured_output"] == 42
