"""``python -m bench.sessions``, in its tiniest pass, so its code cannot rot: every row is
produced (never its value: performance is judged by the bench, not by tests)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_session_bench_reports_each_kind_of_call() -> None:
    done = subprocess.run([sys.executable, "-m", "bench.sessions", "--calls", "2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")][1:]
    assert [row.split(" | ")[0].lstrip("| ") for row in rows] == [
        "python print(1) in a session", "python print(1), one-off sandbox",
        "CreateSession (python) + CloseSession", "echo (no sandbox)"]
    for row in rows:
        p50, p95, calls = (cell.strip() for cell in row.strip("| ").split(" | ")[1:])
        assert float(p50) > 0 and float(p95) > 0 and int(calls) > 0
