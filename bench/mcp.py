"""``python -m bench.mcp``: one tool call three ways, measured in the same run; and the MCP
peer of ``python -m bench``.

- **gRPC**: stargrpc's Execute of ``echo``, the Python SDK (``stargrpc.client``);
- **stargrpc over MCP**: the same call through stargrpc's MCP endpoint (``--mcp-port``),
  the official MCP SDK's client over streamable HTTP — the bridge is a client of the gRPC
  service, so this is the gRPC call plus the MCP hop;
- **a plain MCP server**: an ``echo`` tool written with the official SDK (no auth, no audit,
  no critic), the same client.

Each server runs in its own process on 127.0.0.1, all with authentication off; the client
warms up, then makes ``--calls`` sequential calls (bounded) and prints p50/p99 and each
ratio to the gRPC call. Performance is judged from these printed ratios, never by tests.

    python -m bench.mcp             # 300 calls each
    python -m bench.mcp --smoke     # 20 calls each (the test that keeps this code alive)

The plain server is :func:`peer_server` (``python -m bench.mcp --serve --port N``): an MCP
server of the official SDK over streamable HTTP, as its documentation starts one, with
``echo`` and the benchmark's tools — ``bench_trivial``, ``bench_wait`` (awaits ``ms``) and
``bench_stream`` (reports ``n`` progress notifications, each carrying one delta's text).
``python -m bench`` measures it beside stargrpc through :class:`McpPeerClient`, the SDK's
own client.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx2
import uvicorn
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.server.mcpserver import Context, MCPServer

from stargrpc.client import AsyncClient

ROOT = Path(__file__).resolve().parent.parent
#: Longest wait for a server process to listen.
_START_SECONDS = 60.0



def peer_server() -> MCPServer:
    """The plain MCP server: ``echo`` and the benchmark's tools, written with the SDK."""
    server = MCPServer("bench-peer")

    @server.tool()
    async def echo(text: str) -> str:
        """Say the text back."""
        return text

    @server.tool()
    async def bench_trivial() -> str:
        """Do nothing (call latency)."""
        return ""

    @server.tool()
    async def bench_wait(ms: float = 10.0) -> str:
        """Await ``ms`` milliseconds (concurrency)."""
        await asyncio.sleep(ms / 1000)
        return ""

    @server.tool()
    async def bench_stream(ctx: Context, n: int = 1000) -> str:
        """Report ``n`` progress notifications, each with one delta's text (streaming)."""
        for i in range(1, n + 1):
            await ctx.report_progress(i, n, f"{i:07d}\n")
        return f"streamed {n}"

    return server


async def serve_peer(port: int) -> None:
    """Serves :func:`peer_server` on 127.0.0.1 (``port`` 0: any free one) with uvicorn; prints
    ``{"event": "serving", "address": "mcp:URL"}`` once it listens, and stops on SIGTERM."""
    # Said to be TCP, so that asyncio switches Nagle's algorithm off on every connection
    # accepted (a plain socket() leaves it on: 40 ms more per call, the delayed ACK).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    config = uvicorn.Config(peer_server().streamable_http_app(), log_level="warning",
                            lifespan="on")
    # Listening from here on: a connection made before uvicorn accepts waits in the backlog.
    sock.listen(2048)
    # The same collector settings as `stargrpc serve` and the bare baseline.
    gc.collect()
    gc.freeze()
    gc.set_threshold(5_000, 20, 20)
    print(json.dumps({"event": "serving",
                      "address": f"mcp:http://127.0.0.1:{sock.getsockname()[1]}/mcp"}),
          flush=True)
    await uvicorn.Server(config).serve(sockets=[sock])  # it handles SIGTERM and SIGINT


class McpPeerClient:
    """The official SDK's client over streamable HTTP, as the benchmark client drives it."""

    def __init__(self, url: str) -> None:
        if urlsplit(url).hostname not in ("127.0.0.1", "localhost"):
            raise ValueError("the benchmark only talks to 127.0.0.1")
        self.url = url
        self._stack = contextlib.AsyncExitStack()
        self._client: Client | None = None

    async def open(self) -> McpPeerClient:
        # The SDK's default HTTP client (its own timeouts and connection limits).
        self._client = await self._stack.enter_async_context(
            Client(streamable_http_client(self.url)))  # type: ignore[arg-type]
        return self

    async def call(self, tool: str, arguments: dict[str, Any] | None = None,
                   progress: Callable[[float, float | None, str | None], Awaitable[None]]
                   | None = None, seconds: float = 60.0) -> Any:
        """One tool call to its result; raises when the tool reports an error."""
        assert self._client is not None, "open() first"
        result = await self._client.call_tool(tool, arguments or {},
                                              read_timeout_seconds=seconds,
                                              progress_callback=progress)
        if result.is_error:
            raise RuntimeError(f"{tool}: {result.content}")
        return result

    async def close(self) -> None:
        await self._stack.aclose()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_listening(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + _START_SECONDS
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"a server exited with status {proc.returncode}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port} after {_START_SECONDS:g} s")


async def _measure(call: Callable[[], Awaitable[None]], calls: int) -> list[float]:
    for _ in range(max(3, calls // 10)):  # warm up: connections, caches
        await call()
    took = []
    for _ in range(calls):
        started = time.perf_counter()
        await call()
        took.append(time.perf_counter() - started)
    return took


async def _over_mcp(url: str, calls: int) -> list[float]:
    async with (httpx2.AsyncClient(timeout=30) as http,
                Client(streamable_http_client(url, http_client=http)) as client):  # type: ignore[arg-type]

        async def call() -> None:
            result = await client.call_tool("echo", {"text": "hi"})
            assert not result.is_error

        return await _measure(call, calls)


async def _over_grpc(target: str, calls: int) -> list[float]:
    async with AsyncClient.connect(target) as client:

        async def call() -> None:
            result = await client.call("echo", {"text": "hi"})
            assert result.output == "hi"

        return await _measure(call, calls)


def _row(name: str, took: list[float], base: list[float]) -> str:
    p50, p99 = (statistics.quantiles(took, n=100)[i] * 1000 for i in (49, 98))
    b50, b99 = (statistics.quantiles(base, n=100)[i] * 1000 for i in (49, 98))
    return f"| {name} | {p50:.2f} | {p99:.2f} | {p50 / b50:.2f}x | {p99 / b99:.2f}x |"


def main(argv: list[str] | None = None) -> int:
    """Runs the three measurements and prints the table."""
    parser = argparse.ArgumentParser(prog="python -m bench.mcp", description=__doc__)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--smoke", action="store_true", help="20 calls each")
    parser.add_argument("--serve", action="store_true",
                        help="Only serve the plain MCP server (on --port) until SIGTERM.")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    if args.serve:
        asyncio.run(serve_peer(args.port))
        return 0
    calls = 20 if args.smoke else min(max(args.calls, 10), 10_000)
    grpc_port, mcp_port, plain_port = _free_port(), _free_port(), _free_port()
    with tempfile.TemporaryDirectory(prefix="bench-mcp-") as state:
        env = {**os.environ, "STARGRPC_STATE_DIR": state, "STARGRPC_LOG_LEVEL": "error"}
        procs = [
            subprocess.Popen([sys.executable, "-m", "stargrpc.cli", "serve", "--port",
                              str(grpc_port), "--mcp-port", str(mcp_port),
                              "--insecure-no-auth"], env=env, cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
            subprocess.Popen([sys.executable, "-m", "bench.mcp", "--serve", "--port",
                              str(plain_port)], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
        ]
        try:
            _wait_listening(grpc_port, procs[0])
            _wait_listening(mcp_port, procs[0])
            _wait_listening(plain_port, procs[1])
            grpc_took = asyncio.run(_over_grpc(f"127.0.0.1:{grpc_port}", calls))
            bridge_took = asyncio.run(_over_mcp(f"http://127.0.0.1:{mcp_port}/mcp", calls))
            plain_took = asyncio.run(_over_mcp(f"http://127.0.0.1:{plain_port}/mcp", calls))
        finally:
            for proc in procs:
                proc.send_signal(signal.SIGTERM)
            for proc in procs:
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
    print(f"one echo call, {calls} sequential calls each (ms; ratios to the gRPC call)")
    print("| path | p50 | p99 | p50 ratio | p99 ratio |")
    print("|---|---|---|---|---|")
    print(_row("stargrpc, gRPC Execute", grpc_took, grpc_took))
    print(_row("stargrpc, MCP endpoint", bridge_took, grpc_took))
    print(_row("plain MCP server (official SDK)", plain_took, grpc_took))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
