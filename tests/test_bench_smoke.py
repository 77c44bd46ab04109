"""The benchmark's tiniest pass, so the bench code cannot rot: ``python -m bench --smoke``.

It starts the bare baseline, the floor (the baseline plus the layers' minimum I/O) and
stargrpc as processes, drives all three with the bench client, then stargrpc and the floor
with each layer off in turn, and writes its results. Only that numbers were produced is
checked — never their values: these machines are shared, and performance is judged by
``python -m bench``, not by tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_smoke_pass_produces_every_figure(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--smoke", "--results-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=110, check=False)

    assert done.returncode == 0, done.stderr[-3000:]
    [saved] = tmp_path.glob("*-smoke.json")
    results = json.loads(saved.read_text())
    assert results["machine"]["cores"] >= 1
    for row in results["rows"]:
        # Each row has a figure; a row about the baseline alone has no stargrpc one.
        assert isinstance(row["stargrpc"] if row["stargrpc"] is not None else row["baseline"],
                          float), row
        # The floor has every figure both servers have.
        if row["stargrpc"] is not None and row["baseline"] is not None:
            assert isinstance(row["floor"], float), row
    for server in ("stargrpc", "floor", "baseline"):
        figures = results["raw"][server]
        assert figures["held"]["opened"] == figures["held"]["streams"]
        assert figures["stream"]["best"]["events"] == results["sizes"]["stream_n"]
    # The per-layer costs, stargrpc's and the floor's: each floor layer stargrpc runs with
    # (the critic has no I/O, so no floor) has its figure with that layer off.
    layers = results["layers_cpu"]
    assert isinstance(layers["cpu_us_per_call"]["all on"], float)
    floor = layers["floor_cpu_us_per_call"]
    present = [layer for layer in ("audit", "run log", "auth")
               if results["layers"][layer].startswith("on")]
    expected = {"all on", *(f"{layer} off" for layer in present),
                *(["all off"] if present else [])}
    assert set(floor) == expected, floor
    assert all(isinstance(value, float) for value in floor.values()), floor
    assert "| floor cost | floor share |" in done.stdout
    assert "| Call latency p50" in done.stdout
    assert (tmp_path / saved.name.replace(".json", ".md")).exists()


def test_new_runs_go_to_an_ignored_folder_unless_kept() -> None:
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", "bench/runs/20990101T000000Z-full.json"],
        cwd=ROOT, timeout=30, check=False)
    assert ignored.returncode == 0
    kept = subprocess.run(
        ["git", "check-ignore", "-q", "bench/results/20990101T000000Z-full.json"],
        cwd=ROOT, timeout=30, check=False)
    assert kept.returncode == 1
    assert len(list((ROOT / "bench" / "results").glob("*-full.json"))) == 1


def test_keep_and_a_results_dir_together_are_refused(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--keep", "--results-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert "--keep" in done.stderr
    assert not any(tmp_path.iterdir())
