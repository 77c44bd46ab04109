"""The Python client SDK of stargrpc.

Async::

    from stargrpc.client import AsyncClient, StepDelta

    async with AsyncClient.connect("localhost:50051", api_key=key) as client:
        catalog = await client.list_tools()
        async for event in client.execute("count", {"to": 3}):
            if isinstance(event, StepDelta):
                print(event.text, end="")
        result = await client.call("echo", {"text": "hi"})

Blocking::

    from stargrpc.client import Client

    with Client("localhost:50051", api_key=key) as client:
        print(client.call("echo", {"text": "hi"}).output)

Both clients send the credentials, give every call an idempotency key, retry refused calls
with backoff (honouring RetryInfo), reload a stale catalog once, and resume a broken stream
with WatchRun from the last event seen — see :mod:`stargrpc.client.aio`.
"""

from __future__ import annotations

import importlib
from typing import Any

from stargrpc.client.aio import AsyncClient
from stargrpc.client.channel import open_channel
from stargrpc.client.errors import CallError, ClientError, ResumeError, Violation
from stargrpc.client.events import (
    Catalog,
    Event,
    FileChunk,
    Heartbeat,
    InjectedTool,
    LaneQueued,
    Notice,
    Result,
    RichMessage,
    SentFile,
    Step,
    StepDelta,
    StepEnded,
    StepStarted,
    ToolInfo,
    ToolRunError,
    Usage,
    event_from_proto,
)
from stargrpc.client.retry import NO_RETRY, RetryPolicy
from stargrpc.client.sync import Client
from stargrpc.contract import Outcome

# The remote tool registry (stargrpc.remote_registry) runs tools inside a server's pipeline,
# so it needs the server's modules: it is not part of the SDK. Its names still resolve here
# for code written when it was (loaded on first use, PEP 562); they are not in __all__.
_MOVED = frozenset({
    "FALLBACK_METHOD",
    "IN_PROCESS_METHOD",
    "CollectedWriteBack",
    "RemoteToolRegistry",
    "WriteBackTarget",
})

__all__ = [
    "NO_RETRY",
    "AsyncClient",
    "CallError",
    "Catalog",
    "Client",
    "ClientError",
    "Event",
    "FileChunk",
    "Heartbeat",
    "InjectedTool",
    "LaneQueued",
    "Notice",
    "Outcome",
    "Result",
    "ResumeError",
    "RetryPolicy",
    "RichMessage",
    "SentFile",
    "Step",
    "StepDelta",
    "StepEnded",
    "StepStarted",
    "ToolInfo",
    "ToolRunError",
    "Usage",
    "Violation",
    "event_from_proto",
    "open_channel",
]


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module 'stargrpc.client' has no attribute {name!r}")
    value = getattr(importlib.import_module("stargrpc.remote_registry"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
