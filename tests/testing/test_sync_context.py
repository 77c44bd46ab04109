"""A plain ``def`` tool gets the full context: nested steps, deltas, heartbeats, the
write-back channels and its audit view."""

from __future__ import annotations

from pydantic import BaseModel

from stargrpc import Outcome, SyncToolContext, tool
from stargrpc.testing import run_tool


class Job(BaseModel):
    name: str
    secret: str = ""


@tool()
def build(ctx: SyncToolContext, args: Job) -> str:
    """Builds in nested steps, from a worker thread."""
    ctx.delta("start\n")
    with ctx.step("fetch") as fetch:
        fetch.delta("fetched\n")
        with ctx.step("unpack", detail={"files": 2}):
            ctx.delta("unpacked\n")
            ctx.heartbeat("unpacking", progress=0.5)
        fetch.summary = "2 files"
    with ctx.step("compile"):
        ctx.send_file("out.txt", b"built")
    ctx.audit_view(arguments={"name": args.name}, result="built")
    return f"built {args.name}"


async def test_a_sync_tool_has_nested_steps_and_its_audit_view() -> None:
    recorded = await run_tool(build, {"name": "app", "secret": "hunter2"})

    assert recorded.outcome is Outcome.OK, recorded.result
    tree = recorded.steps
    assert tree.outline() == ["build", [["fetch", [["unpack", []]]], ["compile", []]]]
    assert tree.deltas == "start\n"
    assert tree.find("fetch").deltas == "fetched\n"
    assert tree.find("fetch").step.summary == "2 files"
    assert tree.find("unpack").deltas == "unpacked\n"
    assert tree.find("unpack").step.detail == {"files": 2}
    assert all(node.status == "COMPLETE" for node in tree.walk())
    assert [h.message for h in recorded.heartbeats] == ["unpacking"]
    assert [f.content for f in recorded.sent_files] == [b"built"]
    assert recorded.audit is not None
    assert recorded.audit.arguments == {"name": "app"} and recorded.audit.result == "built"


@tool()
def breaks(ctx: SyncToolContext) -> str:
    """Raises inside a step."""
    with ctx.step("doomed"):
        raise RuntimeError("boom")


async def test_a_sync_step_left_by_an_exception_ends_in_error() -> None:
    recorded = await run_tool(breaks, {})

    assert recorded.outcome is Outcome.ERROR
    assert recorded.error_code == "TOOL_EXCEPTION"
    assert recorded.steps.find("doomed").status == "ERROR"
