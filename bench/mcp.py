"""``python -m bench.mcp``: one ``echo`` call through stargrpc's MCP endpoint beside plain MCP
servers, each driven by two MCP clients, measured in the same run; and the MCP peer of
``python -m bench``.

The servers, each its own process on 127.0.0.1, authentication off (``--auth key``:
stargrpc's servers check an API key, ``--auth jwt`` an ES256 JWT, which every client sends
to every server, as a deployment does):

- **stargrpc**: ``stargrpc serve --mcp-port``; its gRPC Execute of ``echo`` (the Python SDK,
  ``stargrpc.client``) and the same call through its MCP endpoint — the bridge is a client
  of the gRPC service, called in-process (``stargrpc.server.inprocess``: no loopback
  channel), so this is the service's call plus the MCP hop, every interceptor (auth,
  audit, critic) applied;
- **plain FastMCP**: an ``echo`` tool on a FastMCP server (``python -m bench.mcp --serve
  --fastmcp``), served as its documentation serves one over HTTP (no auth, no audit, no
  critic);
- **plain SDK**: the same tool on the official SDK's ``MCPServer`` (:func:`peer_server`);
- with ``--base DIR``, a second stargrpc run from another source tree (``git archive`` of
  a base commit unpacked in ``DIR``): an A/B of the endpoint in the same run;
- with ``--stdio``, the same over stdio: ``stargrpc mcp-stdio`` against the stargrpc server
  (and the base tree's), and the plain FastMCP server over stdio (``python -m bench.mcp
  --serve-stdio``), each a process its client launches.

The clients: the official SDK's ``Client`` over ``streamable_http_client``, and FastMCP's
``Client``; each holds one connection to every MCP server. FastMCP's client sends a
progress token with every call. stargrpc shows a run's steps as progress notifications
(for ``echo``: its step starting and ending) only once the call has run for
``mcp_progress_after_seconds``, so an ``echo`` is answered with its result alone; before
that threshold they turned the answer into an SSE stream. The plain FastMCP server also
has ``echo_with_progress``, the same echo reporting two progress notifications, measured
beside it (the price of the notifications themselves, in the SDKs of both ends; what a
base tree without the threshold pays). The machine is shared, so the
servers take turns ``--block`` calls at a time (after a warm-up), round after round; each
``--repeats`` pass gives every path a median, and the figure printed is the median of those
medians (p99 over all the calls). The ratios that judge the endpoint are stargrpc-MCP / plain
server **with the same client** (the issue's target: ≤ 1.3x plain FastMCP), printed,
never asserted by tests.

    python -m bench.mcp                     # 5 repeats of 200 calls per path
    python -m bench.mcp --base /tmp/base    # also the endpoint of another tree (A/B)
    python -m bench.mcp --stdio             # also over stdio (mcp-stdio, FastMCP's stdio)
    python -m bench.mcp --auth jwt          # stargrpc checks a JWT (or: --auth key)
    python -m bench.mcp --profile out.txt   # py-spy samples the stargrpc server meanwhile
    python -m bench.mcp --smoke             # 1 repeat of 20 calls (the test that keeps this alive)

``--profile`` writes py-spy's raw stacks of the stargrpc server (not the base tree's) to the
file and prints where its busy CPU went (:mod:`bench.profiling`); py-spy must be installed
(``bench/requirements.txt``).

The plain SDK server is :func:`peer_server` (``python -m bench.mcp --serve --port N``): an MCP
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
import jwt
import uvicorn
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from fastmcp import Client as FastMcpClient
from fastmcp import Context as FastMcpContext
from fastmcp import FastMCP
from fastmcp.client.transports import StdioTransport
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.server.mcpserver import Context, MCPServer

from bench import profiling
from stargrpc.auth.keys import KeyStore
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


def fastmcp_server() -> FastMCP:
    """The plain FastMCP server: the same ``echo``, written as FastMCP's documentation writes
    a tool."""
    server = FastMCP("bench-fastmcp")

    @server.tool
    async def echo(text: str) -> str:
        """Say the text back."""
        return text

    @server.tool
    async def echo_with_progress(text: str, ctx: FastMcpContext) -> str:
        """Say the text back after two progress notifications, as stargrpc's ``echo``
        reports its run's step starting and ending to a call that asks for progress."""
        await ctx.report_progress(1, None, "echo")
        await ctx.report_progress(2, None, "echo: ok")
        return text

    return server


async def serve_peer(port: int, *, fastmcp: bool = False) -> None:
    """Serves :func:`peer_server` (or :func:`fastmcp_server`) on 127.0.0.1 (``port`` 0: any
    free one) with uvicorn; prints ``{"event": "serving", "address": "mcp:URL"}`` once it
    listens, and stops on SIGTERM."""
    # Said to be TCP, so that asyncio switches Nagle's algorithm off on every connection
    # accepted (a plain socket() leaves it on: 40 ms more per call, the delayed ACK).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    app = fastmcp_server().http_app() if fastmcp else peer_server().streamable_http_app()
    config = uvicorn.Config(app, log_level="warning", lifespan="on")
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


async def serve_stdio() -> None:
    """Serves :func:`fastmcp_server` over stdio until stdin closes."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(5_000, 20, 20)
    await fastmcp_server().run_stdio_async(show_banner=False, log_level="WARNING")


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


#: One measured call of one path (a path is a server and a client).
Call = Callable[[], Awaitable[None]]


async def _sdk_client(stack: contextlib.AsyncExitStack, url: str, tool: str = "echo",
                      key: str | None = None) -> Call:
    """The official SDK's client, one connection to ``url``, calling ``tool`` (sending
    ``key`` as its bearer credential, when given)."""
    headers = {"Authorization": f"Bearer {key}"} if key else None
    http = await stack.enter_async_context(httpx2.AsyncClient(timeout=30, headers=headers))
    client = await stack.enter_async_context(
        Client(streamable_http_client(url, http_client=http)))

    async def call() -> None:
        result = await client.call_tool(tool, {"text": "hi"})
        assert not result.is_error, result

    return call


async def _fastmcp_client(stack: contextlib.AsyncExitStack, url: str, tool: str = "echo",
                          key: str | None = None) -> Call:
    """FastMCP's client, one connection to ``url``, calling ``tool`` (sending ``key`` as its
    bearer credential, when given)."""
    client = await stack.enter_async_context(FastMcpClient(url, auth=key or None))

    async def call() -> None:
        result = await client.call_tool(tool, {"text": "hi"})
        assert not result.is_error, result

    return call


async def _grpc_client(stack: contextlib.AsyncExitStack, target: str, key: str | None = None
                       ) -> Call:
    client = await stack.enter_async_context(AsyncClient.connect(target, api_key=key))

    async def call() -> None:
        result = await client.call("echo", {"text": "hi"})
        assert result.output == "hi"

    return call


_CLIENTS = {"mcp SDK client": _sdk_client, "FastMCP client": _fastmcp_client}


#: A command that serves MCP over stdio: the program, its arguments, its environment and
#: its folder (``python -m`` imports from there first).
Command = tuple[str, list[str], dict[str, str], Path]


async def _sdk_stdio_client(stack: contextlib.AsyncExitStack, command: Command) -> Call:
    """The official SDK's client, launching ``command`` and calling ``echo``."""
    program, args, env, cwd = command
    client = await stack.enter_async_context(
        Client(StdioServerParameters(command=program, args=args, env=env, cwd=cwd),
               read_timeout_seconds=30))

    async def call() -> None:
        result = await client.call_tool("echo", {"text": "hi"})
        assert not result.is_error, result

    return call


async def _fastmcp_stdio_client(stack: contextlib.AsyncExitStack, command: Command) -> Call:
    """FastMCP's client, launching ``command`` and calling ``echo``."""
    program, args, env, cwd = command
    client = await stack.enter_async_context(
        FastMcpClient(StdioTransport(program, args, env=env, cwd=str(cwd)), timeout=30))

    async def call() -> None:
        result = await client.call_tool("echo", {"text": "hi"})
        assert not result.is_error, result

    return call


_STDIO_CLIENTS = {"mcp SDK client": _sdk_stdio_client,
                  "FastMCP client": _fastmcp_stdio_client}


async def _interleaved(paths: dict[str, Call], calls: int, repeats: int, block: int
                       ) -> dict[str, list[list[float]]]:
    """Every path's call times (seconds), one list per repeat; the paths take turns
    ``block`` calls at a time, so the machine's noise falls on all alike."""
    for call in paths.values():  # warm up: connections, caches, the catalog
        for _ in range(max(3, calls // 10)):
            await call()
    took: dict[str, list[list[float]]] = {name: [] for name in paths}
    for _ in range(repeats):
        lap: dict[str, list[float]] = {name: [] for name in paths}
        while len(next(iter(lap.values()))) < calls:
            for name, call in paths.items():
                for _ in range(min(block, calls - len(lap[name]))):
                    started = time.perf_counter()
                    await call()
                    lap[name].append(time.perf_counter() - started)
        for name, times in lap.items():
            took[name].append(times)
    return took


async def _measure_all(servers: dict[str, str], grpc_target: str, calls: int, repeats: int,
                       block: int, stdio: dict[str, Command] | None = None,
                       key: str | None = None) -> dict[str, list[list[float]]]:
    async with contextlib.AsyncExitStack() as stack:
        paths = {"stargrpc, gRPC Execute (Python SDK)": await _grpc_client(stack, grpc_target,
                                                                           key)}
        for client_name, open_client in _CLIENTS.items():
            for server_name, url in servers.items():
                paths[f"{server_name}, {client_name}"] = await open_client(stack, url, key=key)
            paths[f"{PLAIN_FASTMCP_PROGRESS}, {client_name}"] = await open_client(
                stack, servers[PLAIN_FASTMCP], "echo_with_progress", key=key)
            for server_name, command in (stdio or {}).items():
                paths[f"{server_name}, {client_name}"] = await _STDIO_CLIENTS[client_name](
                    stack, command)
        return await _interleaved(paths, calls, repeats, block)


def _p50(laps: list[list[float]]) -> float:
    """The median of each repeat's median (ms)."""
    return statistics.median(statistics.median(lap) for lap in laps) * 1000


def _p99(laps: list[list[float]]) -> float:
    return statistics.quantiles([t for lap in laps for t in lap], n=100)[98] * 1000


def report(took: dict[str, list[list[float]]], servers: list[str],
           stdio: list[str] | None = None) -> str:
    """The table of every path, and the endpoint's ratios to each plain server with the
    same client."""
    stdio = stdio or []
    calls = sum(len(lap) for lap in next(iter(took.values())))
    lines = [f"one echo call, {calls} calls per path ({len(next(iter(took.values())))} "
             "repeats; p50 = median of the repeats' medians; ms)",
             "| path | p50 | p99 | p50 / plain FastMCP, same client |", "|---|---|---|---|"]
    for name, laps in took.items():
        client = name.rsplit(", ", 1)[-1]
        plain = took.get(f"{PLAIN_FASTMCP}, {client}")
        ratio = f"{_p50(laps) / _p50(plain):.2f}x" if plain is not None else "-"
        lines.append(f"| {name} | {_p50(laps):.2f} | {_p99(laps):.2f} | {ratio} |")
    lines += ["", "stargrpc MCP / plain server, same client (p50; target <= 1.3x plain "
              "FastMCP):"]
    for client in _CLIENTS:
        for endpoint in (s for s in servers if s.startswith("stargrpc")):
            mine = _p50(took[f"{endpoint}, {client}"])
            ratios = ", ".join(f"{mine / _p50(took[f'{plain}, {client}']):.2f}x {plain}"
                               for plain in (PLAIN_FASTMCP, PLAIN_SDK, PLAIN_FASTMCP_PROGRESS))
            lines.append(f"- {endpoint}, {client}: {ratios}")
        plain_stdio = took.get(f"{PLAIN_FASTMCP_STDIO}, {client}")
        for bridge in (s for s in stdio if s.startswith("stargrpc")):
            assert plain_stdio is not None
            mine = _p50(took[f"{bridge}, {client}"])
            lines.append(f"- {bridge}, {client}: {mine / _p50(plain_stdio):.2f}x "
                         f"{PLAIN_FASTMCP_STDIO}")
    return "\n".join(lines)


PLAIN_FASTMCP = "plain FastMCP server"
PLAIN_SDK = "plain MCP server (official SDK)"
#: The FastMCP server's echo reporting two progress notifications when asked for progress,
#: as stargrpc's does (its run's step start and end); FastMCP's client asks on every call.
PLAIN_FASTMCP_PROGRESS = "plain FastMCP server, echo_with_progress"
STARGRPC_MCP = "stargrpc MCP endpoint"
STARGRPC_STDIO = "stargrpc mcp-stdio"
PLAIN_FASTMCP_STDIO = "plain FastMCP server over stdio"


def _stargrpc(tree: Path, grpc_port: int, mcp_port: int, env: dict[str, str], *,
              auth: bool = False) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "stargrpc.cli", "serve", "--port", str(grpc_port),
         "--mcp-port", str(mcp_port), *(() if auth else ("--insecure-no-auth",))],
        env={**env, "PYTHONPATH": str(tree)}, cwd=tree,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _credential(kind: str, folder: Path, env: dict[str, str]) -> str:
    """A credential every client sends: an API key (``kind`` "key") in a keys file, or an
    ES256 JWT (``kind`` "jwt") whose public key is the servers'; ``env`` (both trees'
    servers') is told where they are."""
    keys_file = folder / "bench-keys.json"
    env["STARGRPC_KEYS_FILE"] = str(keys_file)
    if kind == "key":
        return KeyStore(keys_file).create("bench", ["admin"])[1]
    private = ec.generate_private_key(ec.SECP256R1())
    public = folder / "bench-jwt.pem"
    public.write_bytes(private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    env.update(STARGRPC_JWT_PUBLIC_KEY_FILE=str(public), STARGRPC_JWT_ISSUER="bench",
               STARGRPC_JWT_AUDIENCE="stargrpc")
    now = int(time.time())
    return jwt.encode({"sub": "bench", "iss": "bench", "aud": "stargrpc", "iat": now,
                       "exp": now + 24 * 3600, "roles": ["admin"]}, private, algorithm="ES256")


def _stdio_commands(tree: Path, grpc_port: int, env: dict[str, str], name: str,
                    key: str | None = None) -> dict[str, Command]:
    """``stargrpc mcp-stdio`` of ``tree`` against ``grpc_port`` (as ``name``), sending
    ``key`` when given."""
    with_key = {"STARGRPC_API_KEY": key} if key else {}
    return {name: (sys.executable, ["-m", "stargrpc.cli", "mcp-stdio", "--target",
                                    f"127.0.0.1:{grpc_port}", "--log-level", "error"],
                   {**env, **with_key, "PYTHONPATH": str(tree)}, tree)}


def _peer(port: int, env: dict[str, str], *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "bench.mcp", "--serve", "--port", str(port),
                             *extra], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main(argv: list[str] | None = None) -> int:
    """Starts the servers, measures every path and prints the table."""
    parser = argparse.ArgumentParser(prog="python -m bench.mcp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200, help="calls per path per repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--block", type=int, default=5,
                        help="calls in a row on one path before the next takes its turn")
    parser.add_argument("--base", type=Path, default=None,
                        help="another source tree whose stargrpc endpoint is measured too")
    parser.add_argument("--smoke", action="store_true", help="1 repeat of 20 calls")
    parser.add_argument("--serve", action="store_true",
                        help="Only serve a plain MCP server (on --port) until SIGTERM.")
    parser.add_argument("--fastmcp", action="store_true",
                        help="With --serve: the FastMCP server, not the official SDK's.")
    parser.add_argument("--serve-stdio", action="store_true",
                        help="Only serve the plain FastMCP server over stdio.")
    parser.add_argument("--stdio", action="store_true",
                        help="Also measure over stdio: stargrpc mcp-stdio beside the plain "
                        "FastMCP server over stdio.")
    parser.add_argument("--auth", choices=("key", "jwt"), default=None,
                        help="stargrpc's servers check an API key or an ES256 JWT (every "
                        "client sends it)")
    parser.add_argument("--profile", type=Path, default=None,
                        help="py-spy's raw profile of the stargrpc server, written here")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    if args.serve:
        asyncio.run(serve_peer(args.port, fastmcp=args.fastmcp))
        return 0
    if args.serve_stdio:
        asyncio.run(serve_stdio())
        return 0
    calls = 20 if args.smoke else min(max(args.calls, 10), 10_000)
    repeats = 1 if args.smoke else min(max(args.repeats, 1), 50)
    block = min(max(args.block, 1), calls)
    ports = {name: _free_port() for name in ("grpc", "mcp", "fastmcp", "sdk", "base-grpc",
                                            "base-mcp")}
    with tempfile.TemporaryDirectory(prefix="bench-mcp-") as state:
        env = {**os.environ, "STARGRPC_STATE_DIR": state, "STARGRPC_LOG_LEVEL": "error"}
        key = _credential(args.auth, Path(state), env) if args.auth else None
        servers = {STARGRPC_MCP: ports["mcp"], PLAIN_FASTMCP: ports["fastmcp"],
                   PLAIN_SDK: ports["sdk"]}
        procs = [(_stargrpc(ROOT, ports["grpc"], ports["mcp"], env, auth=bool(args.auth)),
                  ports["mcp"]),
                 (_peer(ports["fastmcp"], env, "--fastmcp"), ports["fastmcp"]),
                 (_peer(ports["sdk"], env), ports["sdk"])]
        if args.base is not None:
            base_state = Path(state) / "base"
            base_state.mkdir()
            procs.append((_stargrpc(args.base.resolve(), ports["base-grpc"], ports["base-mcp"],
                                    {**env, "STARGRPC_STATE_DIR": str(base_state)},
                                    auth=bool(args.auth)),
                          ports["base-mcp"]))
            servers[f"{STARGRPC_MCP} (base {args.base.name})"] = ports["base-mcp"]
        stdio: dict[str, Command] = {}
        if args.stdio:
            stdio.update(_stdio_commands(ROOT, ports["grpc"], env, STARGRPC_STDIO, key))
            if args.base is not None:
                stdio.update(_stdio_commands(args.base.resolve(), ports["base-grpc"], env,
                                             f"{STARGRPC_STDIO} (base {args.base.name})",
                                             key))
            stdio[PLAIN_FASTMCP_STDIO] = (sys.executable, ["-m", "bench.mcp", "--serve-stdio"],
                                          {**env, "PYTHONPATH": str(ROOT)}, ROOT)
        recorder: profiling.Recorder | None = None
        try:
            _wait_listening(ports["grpc"], procs[0][0])
            for proc, port in procs:
                _wait_listening(port, proc)
            if args.profile is not None:
                recorder = profiling.Recorder(procs[0][0].pid, args.profile)
            took = asyncio.run(_measure_all(
                {name: f"http://127.0.0.1:{port}/mcp" for name, port in servers.items()},
                f"127.0.0.1:{ports['grpc']}", calls, repeats, block, stdio, key))
        finally:
            profile = recorder.stop() if recorder is not None else None
            for proc, _ in procs:
                proc.send_signal(signal.SIGTERM)
            for proc, _ in procs:
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
    print(report(took, list(servers), list(stdio)))
    if args.profile is not None:
        print("\nthe stargrpc server's busy CPU (py-spy, every path's calls):")
        print(profiling.summarize(profile).render(40) if profile is not None
              else "py-spy wrote no profile")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
