"""``python -m bench.sandbox``: a sandboxed call's latency, warm pool against cold start.

Two ``stargrpc serve`` processes side by side on 127.0.0.1, authentication off, the
isolation the machine gives (bubblewrap where it works): one with the warm pool
(``STARGRPC_SANDBOX_WARM_POOL``, 2 per core unless set), one without (``0``: every call
starts its sandbox). Both with the default settings otherwise, the state socket included
(``sandbox_state_scopes`` run,tree, whatever the environment says): each call inherits its
run's state socket, which the warm server hands to the pooled sandbox at hand-out. The
Python SDK (``stargrpc.client.AsyncClient``) makes sequential calls, the two servers taking
turns 10 calls at a time:

- ``python`` with ``print(1)`` and ``shell`` with ``echo 1``, on each server;
- ``echo`` (no sandbox), on the warm server: what the call costs without a sandbox.

End to end: from the call to its Result at the client. Each call is made once the warm
server's pool is full again (its ``stargrpc_sandbox_pool_ready`` metric polled): an agent
thinks between two calls, and the pool refills meanwhile; a server left idle for that long
would measure this machine's wake-up from idle instead (``--think 0.25`` does that: on this
2-core VM even ``echo`` takes about twice as long after a quarter second idle). How many
calls were handed a warm sandbox is read from the server's metrics and printed beside. A
burst of back-to-back calls, which empties a pool, is the cold figure's case.

The peers' figures are their published ones, not measured here: Daytona, 90 ms from code
to execution; E2B, 0.44 s median from create to the first command (ComputeSDK's
leaderboard, April 2026); both with VM isolation.

    python -m bench.sandbox            # 60 calls per figure
    python -m bench.sandbox --smoke    # 6 calls per figure (the test that keeps it alive)
    python -m bench.sandbox --base /tmp/main --turn 1   # A/B against another checkout

``--base PATH`` starts a third server, with the warm pool, from another checkout of the
project (``git worktree add --detach /tmp/main main``, or ``git archive main | tar -x``)
with the same interpreter: its ``python`` and ``shell`` rows take their turns with this
tree's, each call made once both warm pools are full, so a change to the hand-out is
judged against its base in one run on one machine's load (``base`` rows). A checkout from
before the warm pool (``git archive 4374d76^``: the code issue 28 measured its 30 / 25 ms on)
runs every call cold, and no call waits for its pool: its rows then read this machine
against the issue's, the same code measured on both.

``python -m bench`` runs :func:`measure` and puts its two targets in its table.
Performance is judged from the printed figures, never by tests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stargrpc.client import AsyncClient

ROOT = Path(__file__).resolve().parent.parent
#: Seconds between two calls; 0: none, but each call waits for the warm pool to be full.
THINK_SECONDS = 0.0
#: Longest wait for a server process to listen.
_START_SECONDS = 90.0
#: The issue's targets, p50 in ms from a warm pool.
TARGETS_MS = {"python": 8.0, "shell": 6.0}
#: The peers' published figures, in ms.
PEERS_MS = {"Daytona (code to execution, published)": 90.0,
            "E2B (create to first command, median, ComputeSDK leaderboard April 2026)": 440.0}

CALLS = {
    "python": ("python", {"code": "print(1)"}, "1\n"),
    "shell": ("shell", {"command": "echo 1"}, "1\n"),
    "echo": ("echo", {"text": "1"}, "1"),
}


@dataclass
class Server:
    """A ``stargrpc serve`` process of the bench."""

    name: str
    process: subprocess.Popen[bytes]
    port: int
    metrics_port: int

    def metrics(self) -> str:
        """Its metrics endpoint's text."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                    timeout=10) as response:
            return str(response.read().decode())

    def pooled(self) -> bool:
        """Whether it has a warm pool at all (a checkout from before issue 28 has none)."""
        return "stargrpc_sandbox_pool_ready" in self.metrics()

    def metric(self, name: str, **labels: str) -> float:
        """A sample of its metrics endpoint (0 when absent)."""
        text = self.metrics()
        wanted = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
                         if labels else "")
        for line in text.splitlines():
            if line.startswith(wanted + " "):
                return float(line.split()[-1])
        return 0.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_listening(server: Server) -> None:
    deadline = time.monotonic() + _START_SECONDS
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"{server.name} exited with status {server.process.returncode}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", server.port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"{server.name} does not listen after {_START_SECONDS:g} s")


@contextlib.contextmanager
def servers(pool: str | None, base: Path | None = None) -> Iterator[dict[str, Server]]:
    """The warm and the cold server (and, given ``base``, a warm server run from that
    checkout), stopped (SIGTERM, then SIGKILL) at the end."""
    started: dict[str, Server] = {}
    plan = [("warm", pool, ROOT), ("cold", "0", ROOT)]
    if base is not None:
        plan.append(("base", pool, base))
    with tempfile.TemporaryDirectory(prefix="bench-sandbox-") as tmp:
        try:
            for name, size, tree in plan:
                # The server's tree first on the path (the caller's may name this one).
                path = os.pathsep.join(filter(None, [str(tree),
                                                     os.environ.get("PYTHONPATH", "")]))
                env = {**os.environ, "STARGRPC_STATE_DIR": f"{tmp}/{name}",
                       "STARGRPC_LOG_LEVEL": "error", "PYTHONPATH": path}
                env.pop("STARGRPC_SANDBOX_WARM_POOL", None)
                env.pop("STARGRPC_SANDBOX_STATE_SCOPES", None)  # the default: run, tree
                if size is not None:
                    env["STARGRPC_SANDBOX_WARM_POOL"] = size
                port, metrics_port = _free_port(), _free_port()
                process = subprocess.Popen(
                    [sys.executable, "-m", "stargrpc.cli", "serve", "--port", str(port),
                     "--metrics-port", str(metrics_port), "--insecure-no-auth"],
                    env=env, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                started[name] = Server(name, process, port, metrics_port)
            for server in started.values():
                _wait_listening(server)
            yield started
        finally:
            for server in started.values():
                server.process.send_signal(signal.SIGTERM)
            for server in started.values():
                try:
                    server.process.wait(30)
                except subprocess.TimeoutExpired:
                    server.process.kill()
                    server.process.wait()


async def _pool_full(server: Server, size: int) -> None:
    """Returns once the server's pool holds ``size`` sandboxes of each kind (bounded)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ready = await asyncio.to_thread(
            lambda: [server.metric("stargrpc_sandbox_pool_ready", kind=kind)
                     for kind in ("python", "exec")])
        if min(ready) >= size:
            return
        await asyncio.sleep(0.005)
    raise RuntimeError(f"the warm pool of {server.name} did not fill within 30 s")


async def _turns(clients: dict[str, AsyncClient], lanes: list[tuple[str, str]], calls: int,
                 think: float, before: Any, turn: int = 10
                 ) -> dict[tuple[str, str], list[float]]:
    """Each lane (server, call) ``calls`` times, the lanes taking turns ``turn`` calls at a
    time; a few warm-up calls first. ``before()`` is awaited before each call."""
    took: dict[tuple[str, str], list[float]] = {lane: [] for lane in lanes}

    async def one(server: str, name: str) -> float:
        await before()
        tool, arguments, expected = CALLS[name]
        started = time.perf_counter()
        result = await clients[server].call(tool, arguments)
        elapsed = time.perf_counter() - started
        if not result.output.startswith(expected):
            raise RuntimeError(f"{name} on {server}: unexpected output {result.output!r}")
        return elapsed

    for server, name in lanes:  # warm-up: connections, imports, the first sandbox
        for _ in range(2):
            await one(server, name)
            await asyncio.sleep(think)
    while any(len(values) < calls for values in took.values()):
        for lane in lanes:
            for _ in range(min(turn, calls - len(took[lane]))):
                await asyncio.sleep(think)
                took[lane].append(await one(*lane))
    return took


def measure(calls: int = 60, think: float = THINK_SECONDS, pool: str | None = None,
            base: Path | None = None, turn: int = 10) -> dict[str, Any]:
    """The figures: p50/p99 in ms per (server, call), and the warm server's hand-outs and
    misses over the measured calls (given ``base``, also the rows of a warm server run
    from that checkout: see the module docstring)."""
    lanes = [("warm", "python"), ("cold", "python"), ("warm", "shell"), ("cold", "shell"),
             ("warm", "echo")]
    if base is not None:
        lanes[1:1] = [("base", "python")]
        lanes[4:4] = [("base", "shell")]
        lanes.append(("base", "echo"))
    with servers(pool, base) as running:
        base_pooled = "base" in running and running["base"].pooled()

        async def run() -> dict[tuple[str, str], list[float]]:
            clients = {name: AsyncClient.connect(f"127.0.0.1:{server.port}")
                       for name, server in running.items()}
            size = int(pool) if pool is not None else 2 * (os.cpu_count() or 1)
            waited = [server for name, server in running.items()
                      if name in ("warm", "base") and (name == "warm" or base_pooled)]

            async def before() -> None:
                if size and not think:
                    for server in waited:
                        await _pool_full(server, size)

            try:
                return await _turns(clients, lanes, calls, think, before, turn)
            finally:
                for client in clients.values():
                    await client.close()

        warm = running["warm"]
        before = {kind: (warm.metric("stargrpc_sandbox_pool_handouts_total", kind=kind),
                         warm.metric("stargrpc_sandbox_pool_misses_total", kind=kind))
                  for kind in ("python", "exec")}
        took = asyncio.run(run())
        pooled = {kind: {"handouts": warm.metric("stargrpc_sandbox_pool_handouts_total",
                                                 kind=kind) - before[kind][0],
                         "misses": warm.metric("stargrpc_sandbox_pool_misses_total",
                                               kind=kind) - before[kind][1]}
                  for kind in ("python", "exec")}
    figures = {}
    for (server, name), values in took.items():
        cuts = statistics.quantiles(values, n=100)
        figures[f"{server} {name}"] = {"p50_ms": statistics.median(values) * 1000,
                                       "p99_ms": cuts[98] * 1000, "calls": len(values)}
    return {"figures": figures, "pool": pooled, "think_seconds": think,
            "targets_ms": TARGETS_MS, "peers_ms": PEERS_MS,
            "base": str(base) if base is not None else None,
            "base_pooled": base is not None and base_pooled}


def render(measured: dict[str, Any]) -> list[str]:
    """The Markdown table of :func:`measure`'s figures."""
    figures = measured["figures"]
    echo = figures["warm echo"]["p50_ms"]
    # A base from before the warm pool runs every call cold: its rows say so.
    base = ("warm pool, base" if measured.get("base_pooled", True)
            else "base, which has no pool (every call cold)")
    lines = ["| call (Python SDK, end to end) | p50, ms | p99, ms | p50 vs `echo` | target |",
             "|---|---:|---:|---:|---|"]
    for key, label in (("warm python", "`python` `print(1)`, warm pool"),
                       ("base python", f"`python` `print(1)`, {base}"),
                       ("cold python", "`python` `print(1)`, cold (no pool)"),
                       ("warm shell", "`shell` `echo 1`, warm pool"),
                       ("base shell", f"`shell` `echo 1`, {base}"),
                       ("cold shell", "`shell` `echo 1`, cold (no pool)"),
                       ("warm echo", "`echo` (no sandbox)"),
                       ("base echo", f"`echo` (no sandbox), {base.removeprefix('warm pool, ')}")):
        if key not in figures:
            continue
        figure = figures[key]
        target = ""
        tool = key.split()[1]
        if key.startswith("warm") and tool in TARGETS_MS:
            met = figure["p50_ms"] <= TARGETS_MS[tool]
            target = f"≤ {TARGETS_MS[tool]:g} ms: {'met' if met else '**not met**'}"
        lines.append(f"| {label} | {figure['p50_ms']:.1f} | {figure['p99_ms']:.1f} | "
                     f"{figure['p50_ms'] / echo:.1f}x | {target} |")
    for peer, value in measured["peers_ms"].items():
        lines.append(f"| {peer} | {value:g} | — | {value / echo:.0f}x | |")
    pool = measured["pool"]
    lines.append("")
    pause = (f"{measured['think_seconds']:g} s between calls" if measured["think_seconds"]
             else "each call made once the warm pool was full again")
    lines.append(f"{pause}; the warm server handed "
                 f"out {pool['python']['handouts']:.0f} python and "
                 f"{pool['exec']['handouts']:.0f} shell sandboxes from its pool, and "
                 f"started {pool['python']['misses']:.0f} and {pool['exec']['misses']:.0f} "
                 "on demand (pool empty).")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Measures and prints the table."""
    parser = argparse.ArgumentParser(prog="python -m bench.sandbox",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--think", type=float, default=THINK_SECONDS,
                        help="Seconds between two calls.")
    parser.add_argument("--pool", default=None,
                        help="The warm server's sandbox_warm_pool [default: 2 per core].")
    parser.add_argument("--smoke", action="store_true", help="6 calls per figure")
    parser.add_argument("--turn", type=int, default=10,
                        help="Calls a lane makes before the next takes its turn (1: the "
                             "lanes alternate call by call, for an A/B on a noisy machine).")
    parser.add_argument("--base", type=Path, default=None,
                        help="Another checkout of the project: its warm server's rows too.")
    args = parser.parse_args(argv)
    if args.base is not None and not (args.base / "stargrpc" / "__init__.py").is_file():
        parser.error(f"--base {args.base}: not a checkout of the project")
    calls = 6 if args.smoke else min(max(args.calls, 10), 5_000)
    base = args.base.resolve() if args.base is not None else None
    measured = measure(calls, max(args.think, 0.0), args.pool, base, max(args.turn, 1))
    print(f"a sandboxed call, {calls} sequential calls per row, {max(args.turn, 1)} at a "
          "time"
          + (f"; base: {base}" if base is not None else ""))
    print("\n".join(render(measured)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
