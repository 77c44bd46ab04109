"""``python -m bench.mcp``: one tool call three ways, measured in the same run.

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
"""

from __future__ import annotations

import argparse
import asyncio
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

import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from stargrpc.client import AsyncClient

ROOT = Path(__file__).resolve().parent.parent
#: Longest wait for a server process to listen.
_START_SECONDS = 60.0

_PLAIN_SERVER = """
import sys
from mcp.server.mcpserver import MCPServer

server = MCPServer("plain-echo")

@server.tool()
async def echo(text: str) -> str:
    \"\"\"Say the text back.\"\"\"
    return text

import uvicorn
uvicorn.run(server.streamable_http_app(), host="127.0.0.1", port=int(sys.argv[1]),
            log_level="warning")
"""


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
    args = parser.parse_args(argv)
    calls = 20 if args.smoke else min(max(args.calls, 10), 10_000)
    grpc_port, mcp_port, plain_port = _free_port(), _free_port(), _free_port()
    with tempfile.TemporaryDirectory(prefix="bench-mcp-") as state:
        env = {**os.environ, "STARGRPC_STATE_DIR": state, "STARGRPC_LOG_LEVEL": "error"}
        procs = [
            subprocess.Popen([sys.executable, "-m", "stargrpc.cli", "serve", "--port",
                              str(grpc_port), "--mcp-port", str(mcp_port),
                              "--insecure-no-auth"], env=env, cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
            subprocess.Popen([sys.executable, "-c", _PLAIN_SERVER, str(plain_port)], env=env,
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
