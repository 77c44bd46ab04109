"""The benchmark's tiniest pass, so the bench code cannot rot: ``python -m bench --smoke``.

It starts the bare baseline, the floor (the baseline plus the layers' minimum I/O),
stargrpc embedded and as a fleet, ``stargrpc serve --workers 2`` and the peers (the seed
design over Redis streams, an MCP server of the official SDK) as processes, drives them with
the bench client, then stargrpc and the floor with each layer off in turn, and writes its
results. Only that numbers were produced is checked — never their values: these machines
are shared, and performance is judged by ``python -m bench``, not by tests.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: The figures of the peers table each server has (``PARTS`` in bench/__main__.py): the
#: seed design has no stream, --workers is measured for concurrency only.
PEER_FIGURES = {
    "baseline": {"p50", "p99", "concurrency", "stream", "cpu"},
    "baseline-old": {"p50", "p99", "concurrency", "stream", "cpu"},
    "floor": {"p50", "p99", "concurrency", "stream", "cpu"},
    "stargrpc": {"p50", "p99", "concurrency", "stream", "cpu"},
    "fleet": {"p50", "p99", "concurrency", "stream", "cpu"},
    "workers": {"concurrency"},
    "seed": {"p50", "p99", "concurrency", "cpu"},
    "mcp": {"p50", "p99", "concurrency", "stream", "cpu"},
}
#: What each peer needs on this machine beyond Python.
NEEDS = {"fleet": (6379, 5432), "workers": (6379,), "seed": (6379,)}


def _listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
        return True
    return False


def test_bench_smoke_pass_produces_every_figure(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--smoke", "--results-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=170, check=False)

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
        # Issue 31's larger burst counts its failed calls instead of stopping the run.
        assert isinstance(figures["concurrency_many"]["errors"], int)
        assert isinstance(figures["latency_call_by_call"]["p50_ms"], float)
        assert figures["held"]["opened"] == figures["held"]["streams"]
        assert figures["stream"]["best"]["events"] == results["sizes"]["stream_n"]
    # The per-layer costs, stargrpc's and the floor's (measured with the run log in Redis,
    # when it runs here): each floor layer stargrpc runs with (the critic has no I/O, so no
    # floor) has its figure with that layer off.
    layers = results["layers_cpu"]
    assert isinstance(layers["cpu_us_per_call"]["all on"], float)
    floor = layers["floor_cpu_us_per_call"]
    present = [layer for layer in ("audit", "run log", "auth")
               if results["layer_costs_layers"][layer].startswith("on")]
    expected = {"all on", *(f"{layer} off" for layer in present),
                *(["all off"] if present else [])}
    assert set(floor) == expected, floor
    assert all(isinstance(value, float) for value in floor.values()), floor
    assert "| floor cost | floor share |" in done.stdout
    assert "| Call latency p50" in done.stdout
    # The peers: every figure each one takes part in, with its ratio to bare; a peer that
    # cannot run here (no Redis or PostgreSQL) says why instead.
    peers = results["peers"]
    assert set(peers) == set(PEER_FIGURES)
    for name, figures in PEER_FIGURES.items():
        if not all(_listening(port) for port in NEEDS.get(name, ())):
            assert peers[name]["missing"], name
            continue
        for figure in figures:
            value, ratio = peers[name][figure]
            assert isinstance(value, float) and isinstance(ratio, float), (name, figure)
    assert "| system (each its own process) |" in done.stdout
    # The targets table: every target has its figure and a verdict.
    targets = results["targets"]
    assert len(targets) == 11  # issue 28's two sandboxed calls last
    for row in targets:
        if row["measure"].startswith("Fleet") and not _listening(5432):
            continue
        if "`--workers" in row["measure"] and not _listening(6379):
            continue
        if "warm pool" in row["measure"] and results["sandboxed"] is None:
            continue  # no working sandbox here: the run says why
        assert isinstance(row["value"], float) and isinstance(row["met"], bool), row
    assert "| measure | stargrpc | bare grpc.aio | unit | ratio | target | met |" in done.stdout
    # Issue 28's session calls beside one-off ones and echo, when sandboxes run here.
    if results["sandboxed"] is not None:
        assert results["sessions"] is not None and "**Session calls**" in done.stdout
        assert any(line.startswith("| python print(1) in a session |")
                   for line in results["sessions"])
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
