"""``python -m bench.cluster``: stargrpc's Redis run log on a Redis Cluster beside one Redis,
measured in the same run.

Starts, on 127.0.0.1 and ports of its own, a Redis Cluster of 3 primaries and 3 replicas
(``redis-cli --cluster create``) and a single redis-server, then one stargrpc process on
each (``--redis-url redis+cluster://…`` and ``redis://…``; every run's events go through
the run store), and drives both with the same client (``bench/client.py``, one process),
the two servers taking turns call by call: sequential trivial calls (p50, p99) and rounds of
concurrent calls of a tool that waits 10 ms (calls/s). It prints each figure and the ratio
cluster / single. Performance is judged from these printed ratios, never by tests.

    python -m bench.cluster            # 2,000 calls, 200 concurrent, 5 rounds
    python -m bench.cluster --quick    # 500 calls, 100 concurrent, 3 rounds
    python -m bench.cluster --smoke    # 30 calls, 10 concurrent, 1 round (the test's)

Every process it starts is stopped by its PID at the end; every wait is bounded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from bench.ports import free_ports

ROOT = Path(__file__).resolve().parent.parent
#: Longest wait for a server (Redis or stargrpc) to answer, and for the cluster to form.
_START_SECONDS = 90.0


@dataclass(frozen=True)
class Mode:
    """How much a run measures."""

    calls: int
    warmup: int
    concurrent: int
    rounds: int


MODES = {
    "full": Mode(calls=2000, warmup=200, concurrent=200, rounds=5),
    "quick": Mode(calls=500, warmup=50, concurrent=100, rounds=3),
    "smoke": Mode(calls=30, warmup=5, concurrent=10, rounds=1),
}


def _until(what: str, check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + _START_SECONDS
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)  # processes give no event to await
    raise RuntimeError(f"{what} did not happen within {_START_SECONDS:g} s")


def _cli(port: int, *args: str) -> str:
    return subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True,
                          text=True, timeout=10, check=False).stdout.strip()


class Processes:
    """The processes of one run, each stopped by its PID."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.procs: list[subprocess.Popen[bytes]] = []

    def redis(self, port: int, *args: str) -> None:
        """A redis-server on ``port`` (no persistence), once it answers PING."""
        home = self.folder / f"redis-{port}"
        home.mkdir()
        self.procs.append(subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(home), *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        _until(f"redis on {port} answering", lambda: _cli(port, "ping") == "PONG")

    def cluster(self) -> str:
        """A 3-primary, 3-replica cluster, every slot served and every replica in sync; its
        ``redis+cluster://`` URL."""
        ports = free_ports(6, bus=True)
        for port in ports:
            self.redis(port, "--cluster-enabled", "yes", "--cluster-node-timeout", "2000",
                       "--cluster-config-file", f"nodes-{port}.conf")
        made = subprocess.run(["redis-cli", "--cluster", "create",
                               *(f"127.0.0.1:{port}" for port in ports),
                               "--cluster-replicas", "1", "--cluster-yes"],
                              capture_output=True, text=True, timeout=60, check=False)
        if made.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {made.stdout[-500:]}")
        _until("the cluster state ok", lambda: all(
            "cluster_state:ok" in _cli(port, "cluster", "info") for port in ports))
        _until("every replica in sync", lambda: sum(
            "master_link_status:up" in _cli(port, "info", "replication")
            for port in ports) == 3)
        return "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in ports)

    def stargrpc(self, redis_url: str) -> str:
        """A stargrpc server (the bench tools, no auth) whose run store is ``redis_url``;
        its target once it listens."""
        port = free_ports(1)[0]
        state = self.folder / f"state-{port}"
        env = {**os.environ, "STARGRPC_STATE_DIR": str(state), "STARGRPC_LOG_LEVEL": "error",
               "STARGRPC_SHUTDOWN_GRACE_SECONDS": "1"}
        env.pop("STARGRPC_CONFIG", None)
        proc = subprocess.Popen(
            [sys.executable, "-m", "stargrpc.cli", "serve", "--port", str(port),
             "--tools-dir", "bench/tools", "--insecure-no-auth", "--redis-url", redis_url],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(proc)

        def listening() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"stargrpc exited with status {proc.returncode}")
            with socket.socket() as sock:
                return sock.connect_ex(("127.0.0.1", port)) == 0

        _until(f"stargrpc listening on {port}", listening)
        return f"127.0.0.1:{port}"

    def stop(self) -> None:
        """SIGTERM to each (stargrpc flushes and exits), SIGKILL to any still there."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(10)


@contextlib.contextmanager
def _servers() -> Iterator[tuple[str, str]]:
    """The targets of stargrpc on a cluster and on one Redis, while they run."""
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as folder:
        procs = Processes(Path(folder))
        try:
            cluster_url = procs.cluster()
            single_port = free_ports(1)[0]
            procs.redis(single_port)
            yield (procs.stargrpc(cluster_url),
                   procs.stargrpc(f"redis://127.0.0.1:{single_port}/0"))
        finally:
            procs.stop()


def measure(mode: Mode) -> dict[str, list[dict[str, float]]]:
    """Runs the client's plan against both servers; its figures (cluster first)."""
    plan = [{"measure": "latency", "calls": mode.calls, "warmup": mode.warmup},
            {"measure": "concurrency", "concurrent": mode.concurrent, "rounds": mode.rounds,
             "ms": 10.0}]
    with _servers() as (cluster, single):
        done = subprocess.run(
            [sys.executable, "-m", "bench.client", "--target", cluster, "--target", single,
             "--plan", json.dumps(plan)], cwd=ROOT, capture_output=True, text=True,
            timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the client failed: {(done.stdout + done.stderr)[-1000:]}")
    figures: dict[str, list[dict[str, float]]] = json.loads(done.stdout)
    return figures


def table(figures: dict[str, list[dict[str, float]]]) -> list[str]:
    """The figures as Markdown rows: cluster, single, ratio cluster / single."""
    (c_lat, s_lat), (c_con, s_con) = figures["latency"], figures["concurrency"]
    rows = [("latency p50 (ms)", c_lat["p50_ms"], s_lat["p50_ms"]),
            ("latency p99 (ms)", c_lat["p99_ms"], s_lat["p99_ms"]),
            (f"concurrency: {int(c_con['concurrency'])} calls of a 10 ms tool (calls/s)",
             c_con["calls_per_s"], s_con["calls_per_s"])]
    lines = ["| figure | Redis Cluster (3+3) | one Redis | ratio |", "|---|---|---|---|"]
    lines += [f"| {name} | {c:.2f} | {s:.2f} | {c / s:.2f}x |" for name, c, s in rows]
    return lines


def main(argv: list[str] | None = None) -> int:
    """Measures both set-ups and prints the table."""
    parser = argparse.ArgumentParser(prog="python -m bench.cluster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="a reduced pass")
    size.add_argument("--smoke", action="store_true", help="the tiniest pass (the test's)")
    args = parser.parse_args(argv)
    mode = MODES["smoke" if args.smoke else "quick" if args.quick else "full"]
    figures = measure(mode)
    print(f"stargrpc's run log on a Redis Cluster and on one Redis, same client, in turns "
          f"({mode.calls} sequential calls; {mode.rounds} round(s) of {mode.concurrent} "
          f"concurrent calls)")
    print("\n".join(table(figures)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
