"""The concurrent path's two instruments, each in its tiniest pass, so they cannot rot:
``python -m bench.ab --concurrent N`` (servers as processes, the CPU each spends per call in
rounds of N simultaneous runs) and ``python -m bench.callpath --concurrent N`` (the same
calls in-process, without the transport). Only that the figures were produced is checked,
never their values: performance is judged by the bench, not by tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_ab_gives_the_cpu_per_call_of_each_server_under_concurrent_runs() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.ab", "--tree", f"this={ROOT}", "--no-floor",
         "--tree", f"noaudit={ROOT}", "--without", "noaudit=audit",
         "--repeats", "1", "--calls", "25", "--latency-calls", "5",
         "--concurrent", "4", "--concurrent-rounds", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=170, check=False)

    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    figures = json.loads(lines[-1])
    assert set(figures) == {"bare", "this", "noaudit"}
    for name, server in figures.items():
        concurrent = server["concurrent"]
        assert concurrent["errors"] == 0, name
        for figure in ("calls_per_s", "best_calls_per_s", "cpu_us_per_call",
                       "client_cpu_us_per_call", "cores_busy"):
            assert isinstance(concurrent[figure], float), (name, figure)
        assert concurrent["calls_per_s"] > 0, name
    assert any(line.startswith("| server | 4 concurrent 10 ms runs") for line in lines)


@pytest.mark.parametrize("without", ["that=audit", "this=,", "this="])
def test_ab_refuses_a_layer_left_out_of_a_tree_it_was_not_given_or_no_layer(
        without: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.ab", "--tree", f"this={ROOT}", "--without", without],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)

    assert done.returncode == 2
    assert f"--without {without}:" in done.stderr


def test_ab_starts_a_tree_without_a_layer_through_the_launcher_which_refuses_a_typo() -> None:
    # The tree named by --without is started by bench.launch (the server of a tree without
    # it would ignore the name): a layer the chain does not have stops it before it serves,
    # rather than measuring the whole chain under the wrong name.
    done = subprocess.run(
        [sys.executable, "-m", "bench.ab", "--tree", f"this={ROOT}", "--no-floor",
         "--without", "this=audti", "--repeats", "1", "--calls", "5", "--latency-calls", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)

    assert done.returncode != 0
    assert "no layer audti in the chain (it has: audit, auth, critic)" in done.stderr, \
        done.stderr[-3000:]


def test_callpath_measures_calls_started_together() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.callpath", "--concurrent", "3", "--calls", "6",
         "--rounds", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)

    assert done.returncode == 0, done.stderr[-3000:]
    assert "per bench_wait call, 3 at once" in done.stdout, done.stdout
