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
