"""What the critic tests share: a registry of their tools, a run through a real server, its
notices, and the critic verdict metric."""

from __future__ import annotations

import asyncio

import grpc

from stargrpc import metrics
from stargrpc.registry import Registry, spec_of
from stargrpc.server.grpc_server import StargrpcServer
from stargrpc.v1 import events_pb2, tool_service_pb2_grpc
from tests.critic.custom import judged_by_a_crash, judged_by_words, says
from tests.critic.tools import hangs
from tests.helpers import run_tool

WAIT = 30.0  # generous bound on waits for a run to end; never a performance claim


def registry() -> Registry:
    """The custom critics' tools and ``hangs``."""
    return Registry(spec for fn in (says, hangs, judged_by_words, judged_by_a_crash)
                    if (spec := spec_of(fn)) is not None)


def notices(events: list[events_pb2.RunEvent]) -> list[tuple[str, str]]:
    """The (code, message) of each notice of a run, in order."""
    return [(e.notice.code, e.notice.message) for e in events if e.HasField("notice")]


async def execute(server: StargrpcServer, tool_name: str, arguments: dict[str, object],
                  ) -> list[events_pb2.RunEvent]:
    """Every event of an Execute of ``tool_name`` on ``server`` (bounded)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)
        return await asyncio.wait_for(run_tool(stub, tool_name, arguments), WAIT)


def verdicts(verdict: str, critic: str) -> float:
    """How many ``verdict`` verdicts ``critic`` gave so far (the metric)."""
    return metrics.REGISTRY.get_sample_value(
        "tool_executor_critic_verdicts_total", {"verdict": verdict, "critic": critic}) or 0.0
