"""Tools that call tools (``ctx.call``), for the call-tree tests: a caller (async and sync),
a self-calling tree node that fans out and can hold its leaves open, and a recursion bomb."""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel, Field

from stargrpc import ChildRunError, ChildRunRefused, SyncToolContext, ToolContext, tool
from stargrpc.errors import ToolFailed
from stargrpc.registry import Registry, load_registry, spec_of


class CallArgs(BaseModel):
    tool: str = Field(description="The tool to call.")
    arguments: dict[str, Any] = Field(default_factory=dict, description="Its arguments.")
    catch: bool = Field(False, description="Report a failed child instead of failing.")
    timeout: float | None = Field(None, description="The child's timeout.")
    delay: float = Field(0.0, ge=0, le=10, description="Seconds to wait before calling.")
    times: int = Field(1, ge=1, le=5, description="Calls made one after the other.")


def _failure(error: ChildRunError) -> dict[str, Any]:
    refused = isinstance(error, ChildRunRefused)
    return {"failed": error.outcome.name, "code": error.code, "refused": refused,
            "status": error.status.name if isinstance(error, ChildRunRefused) else "",
            "child_run_id": error.run_id}


@tool(kind="test")
async def caller(ctx: ToolContext, args: CallArgs) -> dict[str, Any]:
    """Calls a tool as a child run, inside a step of its own, and reports its Result."""
    if args.delay:
        await asyncio.sleep(args.delay)  # lets the tree's time run out (max_tree_seconds)
    outputs = []
    async with ctx.step("Calling"):
        for _ in range(args.times):
            try:
                child = await ctx.call(args.tool, args.arguments, timeout=args.timeout,
                                       priority=3)
            except ChildRunError as error:
                if not args.catch:
                    raise
                return _failure(error)
            outputs.append([child.run_id, child.output])
    return {"output": child.output, "structured": child.structured_output, "all": outputs,
            "outcome": child.outcome.name, "child_run_id": child.run_id,
            "files": [[f.name, f.content.decode()] for f in child.files]}


@tool(kind="test")
def caller_sync(ctx: SyncToolContext, args: CallArgs) -> dict[str, Any]:
    """Calls a tool as a child run from a plain def tool."""
    with ctx.step("Calling"):
        try:
            child = ctx.call_sync(args.tool, args.arguments, timeout=args.timeout)
        except ChildRunError as error:
            if not args.catch:
                raise
            return _failure(error)
    return {"output": child.output, "outcome": child.outcome.name,
            "child_run_id": child.run_id}


#: Events the ``started`` argument of a held leaf sets once it runs (tests wait on them).
STARTED: dict[str, asyncio.Event] = {}


class NodeArgs(BaseModel):
    levels: int = Field(ge=0, le=10, description="Levels of children below this node.")
    fan_out: int = Field(2, ge=1, le=5, description="Children per node.")
    hold: bool = Field(False, description="Leaves wait until they are cancelled.")
    started: str = Field("", description="A leaf sets STARTED[started] once it runs.")


@tool(kind="test")
async def tree_node(ctx: ToolContext, args: NodeArgs) -> str:
    """A node of a call tree: calls itself ``fan_out`` times with one level less."""
    if args.levels == 0:
        async with ctx.step("Leaf") as step:
            await step.delta(f"leaf {ctx.run_id}\n")
            if args.started:
                STARTED.setdefault(args.started, asyncio.Event()).set()
            while args.hold:
                await ctx.heartbeat("holding")
                await asyncio.sleep(0.2)
        return "leaf"
    child = NodeArgs(levels=args.levels - 1, fan_out=args.fan_out, hold=args.hold)
    results = await asyncio.gather(*(ctx.call("tree_node", child)
                                     for _ in range(args.fan_out)))
    return f"{sum(r.output.count('leaf') for r in results)} leaf"


class BombArgs(BaseModel):
    fan_out: int = Field(1, ge=1, le=4, description="Copies of itself each run calls.")


@tool(kind="test")
async def bomb(ctx: ToolContext, args: BombArgs) -> str:
    """Calls itself without end: the tree's caps must end it."""
    results = await asyncio.gather(*(ctx.call("bomb", args) for _ in range(args.fan_out)),
                                   return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return "never"


class OrphanArgs(BaseModel):
    started: str = Field(description="The name its held child sets in STARTED.")


@tool(kind="test")
async def orphaner(ctx: ToolContext, args: OrphanArgs) -> str:
    """Starts a held child in the background and returns while it still runs."""
    started = STARTED.setdefault(args.started, asyncio.Event())
    child = asyncio.ensure_future(ctx.call("tree_node", NodeArgs(levels=0, hold=True,
                                                                 started=args.started)))
    await started.wait()
    child.add_done_callback(lambda task: task.exception())  # its end is not this run's
    return "left it running"


@tool(kind="test")
async def state_tree_probe(ctx: ToolContext) -> str:
    """Reads the tree scope's ``first`` key, after setting it when absent (the first run of
    a tree to ask sets it to its own id)."""
    tree = ctx.state("tree")
    await tree.compare_and_set("first", None, ctx.run_id)
    return str(await tree.get("first"))


#: Gates the ``gate`` tool waits on, by name (tests open them).
GATES: dict[str, asyncio.Event] = {}


class GateArgs(BaseModel):
    name: str = Field(description="The gate to wait on (GATES[name]).")


@tool(kind="test")
async def gate(ctx: ToolContext, args: GateArgs) -> str:
    """Waits until the test opens its gate, then ends OK."""
    await GATES.setdefault(args.name, asyncio.Event()).wait()
    return "opened"


def tree_registry() -> Registry:
    """The bundled tools and the call-tree test tools."""
    specs = [spec_of(fn) for fn in (caller, caller_sync, tree_node, bomb, flop, orphaner,
                                     state_tree_probe, gate)]
    return Registry([*load_registry().values(), *(spec for spec in specs if spec is not None)])


class FlopArgs(BaseModel):
    message: str = Field("no luck", description="Why it fails.")
    file_bytes: int = Field(0, ge=0, description="Send a file this large first.")


@tool(kind="test")
async def flop(ctx: ToolContext, args: FlopArgs) -> str:
    """Sends a file when asked, then fails (unless the message is empty)."""
    if args.file_bytes:
        ctx.send_file("out.txt", b"x" * args.file_bytes, "text/plain")
    if args.message:
        raise ToolFailed(args.message)
    return "fine"
