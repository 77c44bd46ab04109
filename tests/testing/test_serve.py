"""Testing a tool through a real server: ``testing.serve`` and the pytest plugin."""

from __future__ import annotations

import grpc
import pytest
from pydantic import BaseModel

from stargrpc import Outcome, ToolContext, tool
from stargrpc.client import CallError
from stargrpc.testing import record, serve


class Count(BaseModel):
    to: int


@tool()
async def count(ctx: ToolContext, args: Count) -> str:
    """Counts to a number in a step, and sends the count as a file."""
    async with ctx.step("counting") as step:
        for n in range(1, args.to + 1):
            await step.delta(f"{n}\n")
    ctx.send_file("count.txt", str(args.to).encode())
    return f"counted to {args.to}"


@tool(privileged=True)
async def reboot(ctx: ToolContext) -> str:
    """A privileged tool."""
    return "rebooted"


async def test_serve_gives_a_connected_client() -> None:
    async with serve(count) as client:
        result = await client.call("count", {"to": 3})
        assert result.outcome is Outcome.OK and result.output == "counted to 3"

        recorded = await record(client, "count", {"to": 2})
        assert recorded.deltas == "1\n2\n"
        assert recorded.steps.outline() == ["count", [["counting", []]]]
        assert [f.content for f in recorded.sent_files] == [b"2"]


async def test_serve_with_roles_turns_authentication_on() -> None:
    async with serve(count, reboot, roles=["user"]) as client:
        assert (await client.call("count", {"to": 1})).ok
        with pytest.raises(CallError) as caught:
            await client.call("reboot", {})
        assert caught.value.code == grpc.StatusCode.PERMISSION_DENIED


async def test_the_plugin_fixture_serves_tools_to_named_callers(stargrpc_server) -> None:
    served = await stargrpc_server(count, reboot,
                                   keys={"ops": ["privileged"], "guest": ["user"]})
    assert (await served.client("ops").call("reboot", {})).output == "rebooted"
    with pytest.raises(CallError) as caught:
        await served.client("guest").call("reboot", {})
    assert caught.value.code == grpc.StatusCode.PERMISSION_DENIED
    # Bad input is refused with a status and the server keeps serving.
    with pytest.raises(CallError) as bad:
        await served.client("guest").call("count", {"to": "many"})
    assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert (await served.client("guest").call("count", {"to": 1})).ok
