"""Tools that use run state (``ctx.state``), for the state tests: one async, one sync, each
doing one operation named by its arguments and returning ``{"value": …}``; and a tool that
uses the run and tree scopes in one run."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, Field

from stargrpc import SyncToolContext, ToolContext, tool
from stargrpc.registry import Registry, spec_of
from stargrpc.v1 import events_pb2, tool_service_pb2_grpc
from tests.helpers import key_channel
from tests.runs_support import as_principal, collect, execute_request


class StateArgs(BaseModel):
    scope: str = Field("run", description="Scope.")
    op: str = Field(description="get, set, cas, increment, delete or keys.")
    key: str = Field("", description="Key (or prefix for keys).")
    value: Any = Field(None, description="Value to set.")
    expected: Any = Field(None, description="compare_and_set's expected value.")
    by: int = Field(1, description="increment's step.")
    ttl: float | None = Field(None, description="Entry TTL in seconds.")
    repeat: int = Field(1, ge=1, le=1000, description="Times to do it (increment).")


async def _apply(state: Any, args: StateArgs) -> Any:
    if args.op == "get":
        return await state.get(args.key)
    if args.op == "set":
        return await state.set(args.key, args.value, ttl=args.ttl)
    if args.op == "cas":
        return await state.compare_and_set(args.key, args.expected, args.value, ttl=args.ttl)
    if args.op == "increment":
        value = None
        for _ in range(args.repeat):
            value = await state.increment(args.key, args.by, ttl=args.ttl)
        return value
    if args.op == "delete":
        return await state.delete(args.key)
    return await state.keys(args.key)


@tool(kind="test")
async def state_op(ctx: ToolContext, args: StateArgs) -> dict[str, Any]:
    """Does one run-state operation."""
    return {"value": await _apply(ctx.state(args.scope), args), "run": ctx.run_id}


@tool(kind="test")
def state_op_sync(ctx: SyncToolContext, args: StateArgs) -> dict[str, Any]:
    """Does one run-state operation, blocking."""
    state = ctx.state(args.scope)
    value: Any
    if args.op == "get":
        value = state.get(args.key)
    elif args.op == "set":
        value = state.set(args.key, args.value, ttl=args.ttl)
    elif args.op == "cas":
        value = state.compare_and_set(args.key, args.expected, args.value, ttl=args.ttl)
    elif args.op == "increment":
        for _ in range(args.repeat):
            value = state.increment(args.key, args.by, ttl=args.ttl)
    elif args.op == "delete":
        value = state.delete(args.key)
    else:
        value = state.keys(args.key)
    return {"value": value, "run": ctx.run_id}


@tool(kind="test")
async def state_run_and_tree(ctx: ToolContext) -> dict[str, Any]:
    """Writes its run and tree scopes, reads them back."""
    await ctx.state("run").set("mine", ctx.run_id)
    await ctx.state("tree").set("root", ctx.run_id)
    return {"run": await ctx.state("run").keys(), "tree": await ctx.state("tree").get("root"),
            "id": ctx.run_id}


def state_registry() -> Registry:
    """The state test tools."""
    specs = [spec_of(fn) for fn in (state_op, state_op_sync, state_run_and_tree)]
    return Registry([spec for spec in specs if spec is not None])


async def call_state_tool(stub: Any, tool: str = "state_op", principal: str = "alice",
                          **arguments: Any) -> events_pb2.Result:
    """Runs a state test tool as ``principal`` (a header the test interceptor trusts) and
    returns its Result."""
    events = await collect(stub.Execute(execute_request(tool, arguments),
                                        metadata=as_principal(principal)))
    return events[-1].result


def value_of(result: events_pb2.Result) -> Any:
    """The value a state test tool reports, once it ended OK."""
    assert result.outcome == events_pb2.OUTCOME_OK, result
    return json.loads(result.output)["value"]


async def state_op_run_id(target: str, api_key: str, **arguments: Any) -> str:
    """Runs ``state_op`` on the server at ``target`` with ``api_key`` (a server with
    authentication on, as the client tests start one); the id of its run."""
    async with key_channel(target, api_key) as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        events = await collect(stub.Execute(execute_request("state_op", arguments)))
    result = events[-1].result
    assert result.outcome == events_pb2.OUTCOME_OK, result
    return str(json.loads(result.output)["run"])
