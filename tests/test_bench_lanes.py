"""The lanes benchmark's tiniest pass (``python -m bench.lanes --smoke``), so its code cannot
rot: it must print each figure with a ratio and a target. Never their values: performance is
judged from ``python -m bench.lanes``, not by tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_lanes_smoke_prints_every_figure() -> None:
    done = subprocess.run([sys.executable, "-m", "bench.lanes", "--smoke"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)

    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")][1:]
    assert [row.split("|")[1].strip().split(",")[0] for row in rows] == [
        "trivial p50 through an empty lane", "trivial p50 through an empty lane",
        "the other principal's p50 beside a flood of one (ms)"]
    for row in rows:
        ratio, target, met = (cell.strip() for cell in row.split("|")[3:6])
        assert float(ratio.removesuffix("x")) > 0 and target.startswith("≤")
        assert met in ("yes", "no")
