"""The MCP benchmark's tiniest pass (``python -m bench.mcp --smoke``), so its code cannot
rot: it must print a figure for each of the three paths. Never their values: performance
is judged from ``python -m bench.mcp``, not by tests."""

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
    assert paths == ["stargrpc, gRPC Execute", "stargrpc, MCP endpoint",
                     "plain MCP server (official SDK)"]
    assert all(row.count("x |") == 2 for row in rows[1:])
