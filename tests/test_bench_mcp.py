"""The MCP benchmark's tiniest pass (``python -m bench.mcp --smoke``), so its code cannot
rot: it must print a figure for every path (each server with each client) and the
endpoint's ratios to the plain servers. Never their values: performance is judged from
``python -m bench.mcp``, not by tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_mcp_smoke_prints_every_path() -> None:
    done = subprocess.run([sys.executable, "-m", "bench.mcp", "--smoke"], cwd=ROOT,
                          capture_output=True, text=True, timeout=170, check=False)

    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    paths = [row.split("|")[1].strip() for row in rows[1:]]
    servers = ["stargrpc MCP endpoint", "plain FastMCP server",
               "plain MCP server (official SDK)"]
    assert paths == ["stargrpc, gRPC Execute (Python SDK)",
                     *(f"{server}, {client}" for client in ("mcp SDK client", "FastMCP client")
                       for server in [*servers, "plain FastMCP server, echo_with_progress"])]
    assert all(row.count("x |") == 1 for row in rows[2:])
    ratios = [line for line in done.stdout.splitlines() if line.startswith("- stargrpc")]
    assert [line.split(":")[0] for line in ratios] == [
        "- stargrpc MCP endpoint, mcp SDK client", "- stargrpc MCP endpoint, FastMCP client"]
    assert all(line.count("x plain") == 3 for line in ratios)
