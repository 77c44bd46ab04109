"""The tool-author harness runs a tool without a server."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from stargrpc import Outcome, ToolContext, ToolFailed, tool
from stargrpc.errors import InvalidArgument, PermissionDenied
from stargrpc.principal import Principal
from stargrpc.runs.run import Run
from stargrpc.settings import Settings
from stargrpc.testing import run_tool, run_tool_sync


class Args(BaseModel):
    n: int


@tool()
async def halves(ctx: ToolContext, args: Args) -> str:
    """Halve a number, refusing odd ones."""
    async with ctx.step("halving") as step:
        await step.delta(f"{args.n}/2\n")
    if args.n % 2:
        raise ToolFailed(f"{args.n} is odd")
    return str(args.n // 2)


@tool()
def shout(ctx, args: Args) -> str:
    """A plain def tool, run off the event loop."""
    ctx.delta("working")
    return "!" * args.n


async def test_records_steps_deltas_and_result() -> None:
    recorded = await run_tool(halves, {"n": "8"})

    assert recorded.outcome is Outcome.OK
    assert recorded.output == "4"
    assert recorded.deltas == "8/2\n"
    assert recorded.step_titles == ["halves", "halving"]
    assert [e.seq for e in recorded.events] == list(range(1, len(recorded.events) + 1))


async def test_failure_is_recorded_as_outcome() -> None:
    recorded = await run_tool(halves, {"n": 3})

    assert recorded.outcome is Outcome.FAILED
    assert recorded.result.error.message == "3 is odd"


async def test_bad_arguments_raise_like_the_server() -> None:
    with pytest.raises(InvalidArgument) as caught:
        await run_tool(halves, {"n": "x", "extra": 1})
    assert {v.field for v in caught.value.violations} == {"arguments.n", "arguments.extra"}


def test_sync_tool_and_sync_harness() -> None:
    recorded = run_tool_sync(shout, {"n": 3})

    assert recorded.output == "!!!"
    assert recorded.deltas == "working"


@tool()
async def chatty(ctx: ToolContext) -> str:
    """Logs through its context's logger."""
    ctx.logger.info("chatty_said", words=2)
    return "ok"


@tool()
def chatty_sync(ctx) -> str:
    """Logs through its context's logger, from a worker thread."""
    ctx.logger.info("chatty_sync_said")
    return "ok"


async def test_a_tools_logger_is_bound_with_its_run_and_tool() -> None:
    from structlog.testing import capture_logs

    with capture_logs() as logs:
        recorded = await run_tool(chatty, {})
        synced = await run_tool(chatty_sync, {})

    [line] = [entry for entry in logs if entry["event"] == "chatty_said"]
    assert line["tool"] == "chatty" and line["words"] == 2
    assert line["run_id"] == recorded.events[0].run_id
    [sync_line] = [entry for entry in logs if entry["event"] == "chatty_sync_said"]
    assert sync_line["tool"] == "chatty_sync"
    assert sync_line["run_id"] == synced.events[0].run_id


@tool(privileged=True, allowed_roles=["ops"])
async def wipe(ctx: ToolContext) -> str:
    """A privileged tool."""
    return "wiped"


async def test_run_tool_applies_the_permission_policy() -> None:
    nobody = Principal(id="nobody", roles=frozenset(), method="test")
    with pytest.raises(PermissionDenied) as caught:
        await run_tool(wipe, {}, principal=nobody)
    assert caught.value.reason == "TOOL_NOT_ALLOWED"

    # An admin passes allow lists but not the privilege, which needs its role explicitly.
    admin = Principal(id="root", roles=frozenset({"admin", "ops"}), method="test")
    with pytest.raises(PermissionDenied) as caught:
        await run_tool(wipe, {}, principal=admin)
    assert caught.value.reason == "PRIVILEGED_ROLE_REQUIRED"

    allowed = Principal(id="op", roles=frozenset({"ops", "privileged"}), method="test")
    assert (await run_tool(wipe, {}, principal=allowed)).output == "wiped"
    # The default test caller holds every role.
    assert (await run_tool(wipe, {})).output == "wiped"


async def test_run_tool_applies_the_configured_permissions() -> None:
    settings = Settings(tool_permissions={"halves": {"roles": ["maths"]}})
    guest = Principal(id="guest", roles=frozenset({"reader"}), method="test")
    with pytest.raises(PermissionDenied):
        await run_tool(halves, {"n": 2}, principal=guest, settings=settings)
    maths = Principal(id="m", roles=frozenset({"maths"}), method="test")
    assert (await run_tool(halves, {"n": 2}, principal=maths, settings=settings)).output == "1"


async def test_run_tool_refuses_acting_for_someone_without_the_role() -> None:
    caller = Principal(id="svc", roles=frozenset({"user"}), method="test")
    with pytest.raises(PermissionDenied):
        await run_tool(halves, {"n": 2}, principal=caller, invocation={"end_user": "eve"})


@tool()
async def stuck(ctx: ToolContext) -> str:
    """Waits for a steer that never comes, so the critic's hard cap stops it."""
    async for _ in ctx.steering():
        pass
    return "never"


async def test_run_tool_supervises_with_the_critic() -> None:
    settings = Settings(critic_soft_timeout=0.2, critic_hard_timeout=0.4)
    recorded = await run_tool(stuck, {}, settings=settings)
    assert recorded.outcome is Outcome.TIMEOUT
    assert recorded.error_code.startswith("CRITIC_")


class Login(BaseModel):
    user: str
    password: str


@tool()
async def login(ctx: ToolContext, args: Login) -> str:
    """Hides the password from the audit with its own view."""
    ctx.audit_view(arguments={"user": args.user}, result="logged in")
    return f"token for {args.user}: t0k3n"


async def test_audit_view_is_what_the_audit_keeps() -> None:
    recorded = await run_tool(login, {"user": "ann", "password": "hunter2"})
    assert recorded.audit is not None
    assert recorded.audit.arguments == {"user": "ann"}
    assert recorded.audit.result == "logged in"

    plain = await run_tool(halves, {"n": 4, })
    assert plain.audit is not None
    assert plain.audit.arguments == {"n": 4} and plain.audit.result == "2"


class Secretive(BaseModel):
    api_key: str


@tool()
async def secretive(ctx: ToolContext, args: Secretive) -> str:
    """Returns nothing secret; its argument is a secret by name."""
    return "done"


async def test_the_audit_view_is_redacted_as_the_server_does() -> None:
    recorded = await run_tool(secretive, {"api_key": "sk-live-123456"})
    assert recorded.audit is not None
    assert "sk-live-123456" not in recorded.audit.arguments_text


@tool()
async def everything(ctx: ToolContext) -> str:
    """Uses every channel a tool has."""
    async with ctx.step("outer") as outer:
        await outer.delta("o")
        async with ctx.step("inner") as inner:
            await inner.delta("i")
        async with ctx.step("sibling"):
            await ctx.heartbeat("half", progress=0.5)
    ctx.send_file("report.csv", b"a,b\n1,2\n")
    ctx.send_file("big.bin", b"x" * 3_000_000)
    ctx.inject_tool("follow_up", "Ask again", {"type": "object"})
    ctx.send_rich_message("card", {"title": "Hi"})
    return "ok"


async def test_recorded_run_has_everything_first_class() -> None:
    recorded = await run_tool(everything, {})

    assert recorded.outcome is Outcome.OK
    tree = recorded.steps
    assert tree.outline() == ["everything", [["outer", [["inner", []], ["sibling", []]]]]]
    assert tree.find("outer").deltas == "o" and tree.find("inner").deltas == "i"
    assert all(node.status == "COMPLETE" for node in tree.walk())
    assert [(h.message, h.progress) for h in recorded.heartbeats] == [("half", 0.5)]
    small, big = recorded.sent_files
    assert (small.name, small.mime_type, small.content) == ("report.csv", "text/csv",
                                                            b"a,b\n1,2\n")
    assert big.content == b"x" * 3_000_000 and big.size == 3_000_000
    [injected] = recorded.injected_tools
    assert (injected.name, injected.description, injected.input_schema) == (
        "follow_up", "Ask again", {"type": "object"})
    [card] = recorded.rich_messages
    assert (card.kind, card.payload) == ("card", {"title": "Hi"})
    assert recorded.notices == []


async def test_notices_are_first_class() -> None:
    def steer(run: Run) -> None:
        run.steer("stop waiting", source="principal test")

    @tool(name="listener")
    async def listener(ctx: ToolContext) -> str:
        """Returns the first steering message."""
        async for message in ctx.steering():
            return message
        return ""

    recorded = await run_tool(listener, {}, on_start=steer)
    assert recorded.output == "stop waiting"
    [notice] = recorded.notices
    assert (notice.code, notice.message, notice.source) == (
        "STEERED", "stop waiting", "principal test")
