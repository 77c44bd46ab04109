"""pydantic-ai's ``MCPToolset`` against the MCP endpoint, driven by a scripted model
(``FunctionModel``): the tools it lists, what its model is shown of a call (the tool's
output, not the run's metadata), progress, tool errors, cancellation, credentials, and a
long call run as a task (pydantic-ai drives 2026-07-28 tasks through fastmcp-tasks)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pydantic_ai import Agent
from pydantic_ai.mcp import MCPToolset
from pydantic_ai.messages import (
    ModelMessage,
    ModelResponse,
    RetryPromptPart,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from structlog.testing import capture_logs

from tests.helpers import eventually
from tests.mcp.conftest import McpUnderTest
from tests.mcp.task_helpers import tasks_created


class Script:
    """A model that calls one tool, then answers with what the tool gave it (the content of
    the tool return, or the retry prompt of a tool error)."""

    def __init__(self, tool: str, arguments: dict[str, Any]) -> None:
        self.tool = tool
        self.arguments = arguments
        self.offered: list[str] = []
        self.shown: list[Any] = []

    def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if not self.offered:
            self.offered = [tool.name for tool in info.function_tools]
            return ModelResponse(parts=[ToolCallPart(self.tool, self.arguments)])
        for part in messages[-1].parts:
            if isinstance(part, ToolReturnPart | RetryPromptPart):
                self.shown.append(part.content)
        return ModelResponse(parts=[TextPart("done")])


def toolset(server: McpUnderTest, key: str | None = "", **options: Any) -> MCPToolset[Any]:
    """The endpoint as a toolset, with ``key`` as the bearer token (default: the admin's)."""
    token = server.auth.key if key == "" else key
    return MCPToolset(server.url, auth=token, read_timeout=30, **options)


async def run(server: McpUnderTest, script: Script, **options: Any) -> str:
    """One agent run of ``script`` with the endpoint's tools; its output."""
    agent = Agent(FunctionModel(script), toolsets=[toolset(server, **options)])
    result = await agent.run("go")
    return str(result.output)


async def test_the_model_is_offered_the_tools_and_shown_their_output(
        eager_mcp_server: McpUnderTest) -> None:
    mcp_server = eager_mcp_server  # every step of the short count (progress threshold 0)
    progress: list[str | None] = []

    async def on_progress(value: float, total: float | None, message: str | None) -> None:
        progress.append(message)

    script = Script("count", {"to": 3})
    assert await run(mcp_server, script, progress_handler=on_progress) == "done"
    assert {"echo", "count", "measure", "wait_at_gate"} <= set(script.offered)
    assert script.shown == ["counted to 3"]
    assert "Counting to 3: 2" in progress
    # Run facts beside the text stay in _meta: the model reads the text.
    facts = Script("facts", {})
    await run(mcp_server, facts)
    assert facts.shown == ["the answer is 42"]


async def test_a_tool_error_reaches_the_model_to_correct(mcp_server: McpUnderTest) -> None:
    broken = Script("breaks", {})
    await run(mcp_server, broken)
    assert len(broken.shown) == 1 and "ERROR" in str(broken.shown[0])
    wrong = Script("count", {"to": "many"})
    await run(mcp_server, wrong)
    assert "to" in str(wrong.shown[0]) and "INVALID_ARGUMENT" in str(wrong.shown[0])


async def test_credentials_are_required(mcp_server: McpUnderTest) -> None:
    with pytest.raises(Exception, match="credentials"):
        await run(mcp_server, Script("echo", {"text": "x"}), key="not-a-key")
    limited = mcp_server.auth.add_key("limited", "user")
    script = Script("echo", {"text": "as limited"})
    await run(mcp_server, script, key=limited)
    assert "ops_only" not in script.offered and script.shown == ["as limited"]


async def test_cancelling_the_agent_run_cancels_the_tool_run(
        mcp_server: McpUnderTest, gate: tuple[str, asyncio.Event, asyncio.Event]) -> None:
    name, _, cancelled = gate
    waiting = asyncio.Event()

    async def on_progress(value: float, total: float | None, message: str | None) -> None:
        if message and "waiting at the gate" in message:
            waiting.set()

    agent_run = asyncio.create_task(run(mcp_server, Script("wait_at_gate", {"gate": name}),
                                        progress_handler=on_progress))
    await asyncio.wait_for(waiting.wait(), 20)
    agent_run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await agent_run
    await asyncio.wait_for(cancelled.wait(), 10)


async def test_a_long_call_runs_as_a_task(
        tasks_server: McpUnderTest, gate: tuple[str, asyncio.Event, asyncio.Event]) -> None:
    name, opened, _ = gate
    script = Script("wait_at_gate", {"gate": name})
    with capture_logs() as logs:
        agent_run = asyncio.create_task(run(tasks_server, script))
        await eventually(lambda: tasks_created(logs), what="a task")  # answered: a task
        opened.set()
        assert await asyncio.wait_for(agent_run, 30) == "done"
    assert script.shown == ["through the gate"]
    assert tasks_created(logs) == ["wait_at_gate"]
