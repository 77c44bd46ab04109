"""Support for the approval tests: tools that need approval, a server with keys for the
people involved, and stream helpers."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import grpc
from pydantic import BaseModel, Field

from stargrpc import ToolContext, tool
from stargrpc.registry import NoArguments, Registry, spec_of
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.helpers import key_channel

#: The runs whose tool body ran, by run id: a denied run must never appear here.
BODIES_RUN: list[str] = []


class DeployArgs(BaseModel):
    service: str = Field(description="What to deploy.")
    target: str = Field("staging", description="Where to.")
    api_token: str = Field("", description="A secret the audit must not show.")


@tool(approval=True)
async def deploy(ctx: ToolContext, args: DeployArgs) -> str:
    """Deploys a service; a person approves each deployment first."""
    BODIES_RUN.append(ctx.run_id)
    return f"deployed {args.service} to {args.target}"


class WipeArgs(BaseModel):
    path: str


@tool(destructive=True)
async def wipe(ctx: ToolContext, args: WipeArgs) -> str:
    """Deletes a folder (annotated destructive)."""
    BODIES_RUN.append(ctx.run_id)
    return f"wiped {args.path}"


@tool()
async def greet(ctx: ToolContext, args: NoArguments) -> str:
    """Says hello; needs nobody's approval."""
    BODIES_RUN.append(ctx.run_id)
    return "hello"


def approval_registry() -> Registry:
    """The approval test tools."""
    return Registry([spec_of(fn) for fn in (deploy, wipe, greet)])  # type: ignore[misc]


def execute_request(tool_name: str, arguments: dict[str, Any] | None = None,
                    **fields: Any) -> tool_service_pb2.ExecuteRequest:
    """An ExecuteRequest with JSON arguments."""
    request = tool_service_pb2.ExecuteRequest(tool_name=tool_name, **fields)
    request.arguments_json = json.dumps(arguments or {})
    return request


async def read_until_approval(call: Any) -> tuple[list[events_pb2.RunEvent],
                                                  events_pb2.ApprovalRequest]:
    """Reads an Execute (or WatchRun) stream up to its APPROVAL_REQUIRED notice."""
    seen = []
    async with asyncio.timeout(30):
        while (response := await call.read()) is not grpc.aio.EOF:
            seen.append(response.event)
            if response.event.notice.code == "APPROVAL_REQUIRED":
                return seen, response.event.notice.approval
    raise AssertionError(f"the stream ended without APPROVAL_REQUIRED: {seen}")


async def rest_of(call: Any) -> list[events_pb2.RunEvent]:
    """Every remaining event of a stream (bounded in time)."""
    events = []
    async with asyncio.timeout(30):
        while (response := await call.read()) is not grpc.aio.EOF:
            events.append(response.event)
    return events


def approve_request(run_id: str, approval_id: str, *, deny: bool = False, reason: str = "",
                    digest: str = "") -> tool_service_pb2.ApproveRunRequest:
    """An ApproveRunRequest."""
    return tool_service_pb2.ApproveRunRequest(
        run_id=run_id, approval_id=approval_id, reason=reason, arguments_digest=digest,
        decision=tool_service_pb2.APPROVAL_VERDICT_DENY if deny
        else tool_service_pb2.APPROVAL_VERDICT_APPROVE)


@dataclass
class People:
    """Stubs for each person of the approval tests, on one server with keys:
    alice (runs tools), bob and carol (approvers), mallory (no role), root (admin)."""

    alice: tool_service_pb2_grpc.ToolServiceStub
    bob: tool_service_pb2_grpc.ToolServiceStub
    carol: tool_service_pb2_grpc.ToolServiceStub
    mallory: tool_service_pb2_grpc.ToolServiceStub
    root: tool_service_pb2_grpc.ToolServiceStub


@asynccontextmanager
async def people_of(auth: Any) -> AsyncIterator[People]:
    """:class:`People` calling the server of ``auth`` (a tests.conftest AuthServer, whose
    own key is root's)."""
    keys = {"alice": auth.add_key("alice"), "bob": auth.add_key("bob", "approver"),
            "carol": auth.add_key("carol", "approver"), "mallory": auth.add_key("mallory"),
            "root": auth.key}
    channels = {name: key_channel(auth.target, secret) for name, secret in keys.items()}
    try:
        yield People(**{name: tool_service_pb2_grpc.ToolServiceStub(channel)
                        for name, channel in channels.items()})
    finally:
        for channel in channels.values():
            await channel.close()
