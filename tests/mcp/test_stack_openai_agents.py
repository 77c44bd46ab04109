"""openai-agents' ``MCPServerStreamableHttp`` against the MCP endpoint, in a ``Runner`` with a
scripted model: the tools it offers the model, what the model is shown of a call, tool
errors, credentials, cancellation, and a long call (it has no progress callback and no
tasks: a long call is one long request)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from agents import Agent, Runner
from agents.items import ModelResponse
from agents.mcp import MCPServerStreamableHttp
from agents.models.interface import Model
from agents.usage import Usage
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)

from stargrpc.stores.base import RunQuery, RunStore
from tests.helpers import eventually
from tests.mcp.conftest import McpUnderTest
from tests.mcp.mcp_tools import CANCELLED, GATES


class ScriptedModel(Model):
    """Calls one tool, then answers "done"; keeps what it was offered and shown."""

    def __init__(self, tool: str, arguments: dict[str, Any]) -> None:
        self.tool = tool
        self.arguments = arguments
        self.offered: list[str] = []
        self.shown: list[str] = []

    async def get_response(self, system_instructions: str | None, input: Any,
                           model_settings: Any, tools: list[Any], output_schema: Any,
                           handoffs: list[Any], tracing: Any, **_: Any) -> ModelResponse:
        if not self.offered:
            self.offered = [tool.name for tool in tools]
            call = ResponseFunctionToolCall(type="function_call", call_id="call-1",
                                            name=self.tool, id="fc-1", status="completed",
                                            arguments=json.dumps(self.arguments))
            return ModelResponse(output=[call], usage=Usage(), response_id=None)
        self.shown += [_text(item["output"]) for item in input
                       if isinstance(item, dict) and item.get("type") == "function_call_output"]
        text = ResponseOutputText(type="output_text", text="done", annotations=[])
        message = ResponseOutputMessage(id="msg-1", type="message", role="assistant",
                                        status="completed", content=[text])
        return ModelResponse(output=[message], usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        raise NotImplementedError("the tests run the agent without streaming")


def _text(output: Any) -> str:
    """A function call's output as the model reads it: its text parts, joined."""
    if isinstance(output, str):
        return output
    return "".join(part["text"] for part in output if part.get("type") == "input_text")


def _leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in _leaves(inner)]
    return [error]


async def run(server: McpUnderTest, model: ScriptedModel, key: str | None = "") -> str:
    """One ``Runner`` run of ``model`` with the endpoint as its MCP server; its output."""
    token = server.auth.key if key == "" else key
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with MCPServerStreamableHttp({"url": server.url, "headers": headers, "timeout": 30},
                                       client_session_timeout_seconds=30) as mcp:
        agent = Agent(name="tester", model=model, mcp_servers=[mcp])
        result = await Runner.run(agent, "go")
    return str(result.final_output)


async def test_the_model_is_offered_the_tools_and_shown_their_output(
        mcp_server: McpUnderTest) -> None:
    model = ScriptedModel("count", {"to": 3})
    assert await run(mcp_server, model) == "done"
    assert {"echo", "count", "measure", "wait_at_gate"} <= set(model.offered)
    assert model.shown == ["counted to 3"]
    facts = ScriptedModel("facts", {})
    await run(mcp_server, facts)
    assert facts.shown == ["the answer is 42"]  # the text, not the run's facts


async def test_tool_errors_reach_the_model(mcp_server: McpUnderTest) -> None:
    broken = ScriptedModel("breaks", {})
    await run(mcp_server, broken)
    assert len(broken.shown) == 1 and "ERROR" in broken.shown[0]
    wrong = ScriptedModel("count", {"to": "many"})
    await run(mcp_server, wrong)
    assert "INVALID_ARGUMENT" in wrong.shown[0] and "to" in wrong.shown[0]


async def test_credentials_are_required(mcp_server: McpUnderTest) -> None:
    with pytest.raises(BaseException) as refused:  # as the stack raises it (a group)
        await run(mcp_server, ScriptedModel("echo", {"text": "x"}), key="not-a-key")
    said = " ".join(str(leaf) for leaf in _leaves(refused.value))
    assert "401" in said or "invalid credentials" in said, said
    limited = mcp_server.auth.add_key("limited", "user")
    model = ScriptedModel("echo", {"text": "as limited"})
    await run(mcp_server, model, key=limited)
    assert "ops_only" not in model.offered and model.shown == ["as limited"]


async def test_a_long_call_and_cancelling_the_run(
        mcp_server: McpUnderTest, gate: tuple[str, asyncio.Event, asyncio.Event]) -> None:
    name, opened, cancelled = gate
    model = ScriptedModel("wait_at_gate", {"gate": name})
    agent_run = asyncio.create_task(run(mcp_server, model))
    store = mcp_server.auth.server.runtime.store
    await _until_running(store, "wait_at_gate")
    opened.set()
    assert await asyncio.wait_for(agent_run, 30) == "done"
    assert model.shown == ["through the gate"]
    # Cancelled mid-call: the run stops too.
    other = ScriptedModel("wait_at_gate", {"gate": name + "-x"})
    GATES[name + "-x"], CANCELLED[name + "-x"] = asyncio.Event(), cancelled
    try:
        agent_run = asyncio.create_task(run(mcp_server, other))
        await _until_running(store, "wait_at_gate")
        agent_run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await agent_run
        await asyncio.wait_for(cancelled.wait(), 10)
    finally:
        GATES.pop(name + "-x").set()
        CANCELLED.pop(name + "-x", None)


async def _until_running(store: RunStore, tool: str) -> None:
    """Waits until a run of ``tool`` is going (this stack shows no progress to wait on)."""
    query = RunQuery(owner=None, limit=10, tool=tool, finished=False)
    await eventually(lambda: _any_run(store, query), what=f"a run of {tool}")


async def _any_run(store: RunStore, query: RunQuery) -> bool:
    return bool((await store.list_runs(query)).runs)
