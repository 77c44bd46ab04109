"""The run state benchmark's tiniest pass (``python -m bench.state --smoke``), so its code
cannot rot: every figure is printed, and each Redis operation is one round trip (a count,
not a time; no time is asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_state_figure_is_printed() -> None:
    done = subprocess.run([sys.executable, "-m", "bench.state", "--smoke"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=True)
    rows = {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines()[2:]}
    assert set(rows) == {"set", "get", "increment", "compare_and_set"}
    for name, figures in rows.items():
        assert len(figures) == 5, (name, figures)
        assert figures[3] == "1.00", (name, figures)  # one Redis round trip each
    assert rows["get"][4] != "-" and rows["set"][4] != "-"
