"""MCP fixtures: a real server with its MCP endpoint on an ephemeral port and API-key
authentication on, the official MCP SDK's client over streamable HTTP, and an MCP server
written with the SDK over streamable HTTP, to be put behind stargrpc."""

from __future__ import annotations

import asyncio
import textwrap
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from stargrpc.mcp import upstream as upstream_module
from stargrpc.server.grpc_server import StargrpcServer
from tests.conftest import AuthServer, AuthServerFactory, ServerFactory
from tests.mcp.mcp_tools import CANCELLED, GATES, mcp_registry
from tests.mcp.upstream_server import Observed, serve_http
from tests.stores.conftest import REDIS_URL, redis_prefix

__all__ = ["redis_prefix"]  # a fixture of the two-replica task tests

#: The protocol eras a client may speak: the initialize handshake, and 2026-07-28.
MODES = ("legacy", "2026-07-28")


@dataclass
class McpUnderTest:
    """A server with ``mcp_port`` on; ``auth.key`` holds the admin role."""

    auth: AuthServer

    @property
    def url(self) -> str:
        """The MCP endpoint."""
        assert self.auth.server.mcp is not None
        return f"http://127.0.0.1:{self.auth.server.mcp.port}/mcp"

    @asynccontextmanager
    async def client(self, key: str | None = "", mode: str = "legacy",
                     event_hooks: dict[str, list[Any]] | None = None,
                     **options: Any) -> AsyncIterator[Client]:
        """An MCP client sending ``key`` (default: the admin key; None: no credentials);
        ``event_hooks`` are its HTTP client's."""
        secret = self.auth.key if key == "" else key
        headers = {"Authorization": f"Bearer {secret}"} if secret else {}
        async with httpx2.AsyncClient(headers=headers, timeout=30,
                                      event_hooks=event_hooks) as http:
            transport = streamable_http_client(self.url, http_client=http)
            async with Client(transport, mode=mode, **options) as client:  # type: ignore[arg-type]
                yield client


@pytest.fixture
async def mcp_server(make_auth_server: AuthServerFactory, tmp_path: Any) -> McpUnderTest:
    """A server with the MCP endpoint and API keys on."""
    tools = tmp_path / "extra_tools"
    tools.mkdir()
    auth = await make_auth_server(mcp_registry(), mcp_port=0, tools_dir=[tools])
    return McpUnderTest(auth)


async def mcp_endpoint(make_auth_server: AuthServerFactory, folder: Path,
                       **settings: Any) -> McpUnderTest:
    """A server with the MCP endpoint, API keys and ``settings`` on, its tools folder and
    keys file in ``folder`` (made)."""
    tools = folder / "tools"
    tools.mkdir(parents=True)
    auth = await make_auth_server(mcp_registry(), mcp_port=0, tools_dir=[tools],
                                  keys_file=folder / "keys.json", **settings)
    return McpUnderTest(auth)


@pytest.fixture
async def eager_mcp_server(make_auth_server: AuthServerFactory, tmp_path: Path
                           ) -> McpUnderTest:
    """An MCP endpoint that shows a call's events from its start
    (``mcp_progress_after_seconds`` 0), for the tests of every step of a short call."""
    return await mcp_endpoint(make_auth_server, tmp_path / "eager",
                              mcp_progress_after_seconds=0)


@pytest.fixture
async def patient_mcp_server(make_auth_server: AuthServerFactory, tmp_path: Path
                             ) -> McpUnderTest:
    """An MCP endpoint that holds a call's events for an hour: every call of a test is
    short."""
    return await mcp_endpoint(make_auth_server, tmp_path / "patient",
                              mcp_progress_after_seconds=3600)


@pytest.fixture
async def tasks_server(make_auth_server: AuthServerFactory, tmp_path: Any) -> McpUnderTest:
    """An MCP endpoint that answers a 2026-07-28 call with a task after 0.2 s, and keeps
    finished runs for 120 s."""
    tools = tmp_path / "task_tools"
    tools.mkdir()
    auth = await make_auth_server(mcp_registry(), mcp_port=0, tools_dir=[tools],
                                  keys_file=tmp_path / "task-keys.json",
                                  mcp_task_after_seconds=0.2, run_retention_seconds=120)
    return McpUnderTest(auth)


@pytest.fixture
async def mcp_replicas(make_auth_server: AuthServerFactory, make_server: ServerFactory,
                       redis_prefix: str, tmp_path: Any) -> tuple[McpUnderTest, McpUnderTest]:
    """Two replicas sharing Redis (runs, hence tasks) and the keys file, each with its MCP
    endpoint; a 2026-07-28 call becomes a task after 0.2 s."""
    shared = {"redis_url": REDIS_URL, "redis_key_prefix": redis_prefix, "mcp_port": 0,
              "mcp_task_after_seconds": 0.2}
    first = await make_auth_server(mcp_registry(), **shared)
    second = await make_server(mcp_registry(), insecure_no_auth=False,
                               keys_file=tmp_path / "keys.json", **shared)
    return McpUnderTest(first), McpUnderTest(AuthServer(second, first.key, first.keys))


@pytest.fixture
def gate() -> Iterator[tuple[str, asyncio.Event, asyncio.Event]]:
    """A fresh gate for ``wait_at_gate`` (opened at teardown) and the event its run sets
    when cancelled."""
    name = uuid.uuid4().hex
    opened = GATES[name] = asyncio.Event()
    cancelled = CANCELLED[name] = asyncio.Event()
    yield name, opened, cancelled
    opened.set()
    GATES.pop(name, None)
    CANCELLED.pop(name, None)


@pytest.fixture
def quick_pings(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dead HTTP server is noticed within a fraction of a second (for the tests of MCP
    servers behind stargrpc: ``pytest.mark.usefixtures("quick_pings")``)."""
    monkeypatch.setattr(upstream_module, "PING_SECONDS", 0.2)


@pytest.fixture
async def http_upstream() -> AsyncIterator[tuple[str, Observed, Any]]:
    """The SDK server over streamable HTTP on 127.0.0.1."""
    async with serve_http() as served:
        yield served


GREET = textwrap.dedent('''
    from pydantic import BaseModel
    from stargrpc import tool

    class A(BaseModel):
        name: str

    @tool()
    async def greet(ctx, args: A) -> str:
        """Greet someone."""
        return f"hello {args.name}"
''')


async def reload_with_greet(server: StargrpcServer, tmp_path: Any,
                            noticed: asyncio.Event) -> None:
    """Adds the greet tool to ``tmp_path/extra_tools`` and reloads (what SIGHUP does) until
    ``noticed`` is set: a handshake-era connection's catalog watch starts with its
    initialized notification, which may still be on its way, and a watch that starts after
    a reload sees no change. Each retry changes the catalog again."""
    for attempt in range(100):
        (tmp_path / "extra_tools" / "greet.py").write_text(
            GREET.replace("Greet someone.", f"Greet someone (version {attempt})."))
        server.reload_tools()
        try:
            await asyncio.wait_for(asyncio.shield(noticed.wait()), 0.1)
            return
        except TimeoutError:
            continue
    raise AssertionError("the catalog change was never noticed")


async def cancel_mid_run(client: Client, gate: str, cancelled: asyncio.Event) -> None:
    """Starts ``wait_at_gate``, cancels the MCP request once its run is waiting (the client
    sends ``notifications/cancelled``) and returns once the run's tool was cancelled."""
    waiting = asyncio.Event()

    async def progress(value: float, total: float | None, message: str | None) -> None:
        if message and "waiting at the gate" in message:
            waiting.set()

    call = asyncio.create_task(
        client.call_tool("wait_at_gate", {"gate": gate}, progress_callback=progress))
    await asyncio.wait_for(waiting.wait(), 20)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await asyncio.wait_for(cancelled.wait(), 10)
