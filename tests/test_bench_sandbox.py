"""The sandboxed calls' benchmark, its tiniest pass (``python -m bench.sandbox --smoke``),
so its code cannot rot: it must print a figure for each call, warm and cold, and the
peers'. Never their values: performance is judged from the bench, not by tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_sandbox_smoke_prints_every_call() -> None:
    done = subprocess.run([sys.executable, "-m", "bench.sandbox", "--smoke", "--think", "0.1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=170, check=False)

    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    calls = [row.split("|")[1].strip() for row in rows[1:]]
    assert calls[:5] == ["`python` `print(1)`, warm pool", "`python` `print(1)`, cold (no pool)",
                         "`shell` `echo 1`, warm pool", "`shell` `echo 1`, cold (no pool)",
                         "`echo` (no sandbox)"]
    assert [call.split(" (")[0] for call in calls[5:]] == ["Daytona", "E2B"]
    assert all(float(row.split("|")[2]) > 0 for row in rows[1:])
    assert "sandboxes from its pool" in done.stdout


def test_a_base_without_a_pool_is_labelled_so() -> None:
    """A base checkout from before the warm pool runs every call cold: its rows must not
    read as warm ones."""
    from bench.sandbox import PEERS_MS, TARGETS_MS, render

    figure = {"p50_ms": 5.0, "p99_ms": 9.0, "calls": 6}
    measured = {"figures": {f"{server} {call}": figure for server in ("warm", "base", "cold")
                            for call in ("python", "shell", "echo")},
                "pool": {kind: {"handouts": 6, "misses": 0} for kind in ("python", "exec")},
                "think_seconds": 0.0, "targets_ms": TARGETS_MS, "peers_ms": PEERS_MS,
                "base": "/tmp/old", "base_pooled": False}

    labels = [row.split("|")[1].strip() for row in render(measured) if row.startswith("| ")]

    assert "`python` `print(1)`, base, which has no pool (every call cold)" in labels
    assert "`shell` `echo 1`, base, which has no pool (every call cold)" in labels
    measured["base_pooled"] = True
    labels = [row.split("|")[1].strip() for row in render(measured) if row.startswith("| ")]
    assert "`python` `print(1)`, warm pool, base" in labels
