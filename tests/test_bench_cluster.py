"""The cluster benchmark's tiniest pass (``python -m bench.cluster --smoke``), so its code
cannot rot: it must print each figure for both set-ups and their ratio. Never their values:
performance is judged from ``python -m bench.cluster``, not by tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_cluster_smoke_prints_every_figure_for_both_setups() -> None:
    done = subprocess.run([sys.executable, "-m", "bench.cluster", "--smoke"], cwd=ROOT,
                          capture_output=True, text=True, timeout=170, check=False)

    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    figures = [row.split("|")[1].strip() for row in rows[1:]]
    assert [figure.split(" (")[0].split(":")[0] for figure in figures] == [
        "latency p50", "latency p99", "concurrency"]
    for row in rows[1:]:
        cluster, single, ratio = (cell.strip() for cell in row.split("|")[2:5])
        assert float(cluster) > 0 and float(single) > 0 and ratio.endswith("x")
