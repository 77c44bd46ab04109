"""``python -m bench.lanes``: what lanes cost, and whether their turns are fair, measured in
the same run.

1. **Admission through an empty lane.** Four ``stargrpc serve`` processes (the bench tools,
   no auth): embedded without lanes, embedded with ``bench_trivial`` in a lane of ample
   capacity (every call takes a slot and gives it back, nobody waits), and the same two as a
   fleet (a redis-server of the run's own; there the calls take their slots from the
   replica's reserve, leased ahead from Redis). The same client (``bench/client.py``, one
   process) drives them in turns; the figure is each lane set-up's trivial p50 over its twin's
   without lanes (issue 26: ≤ 1.03x, embedded and fleet).
2. **Two principals, one flooding.** One embedded server with ``bench_wait`` in a lane of 4
   slots and two API keys: principal ``flood`` starts 1,000 calls of a 50 ms run at once;
   while they wait, principal ``other`` makes calls of the same 50 ms run one after another.
   The figure is ``other``'s p50 call time over its run time (issue 26: ≤ 2x): turns between
   principals put each of its calls behind at most one of the flood's.

    python -m bench.lanes            # 2,000 latency calls, 1,000 flooding, 20 measured
    python -m bench.lanes --quick    # 500, 1,000 and 10
    python -m bench.lanes --smoke    # 30, 100 and 3 (the test's)

Every process it starts is stopped by its PID at the end; every wait is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.cluster import ROOT, Processes

#: The run time of a call in the flood case (ms).
FLOOD_RUN_MS = 50.0
#: Issue 26's targets.
ADMISSION_TARGET = 1.03
FLOOD_TARGET = 2.0


@dataclass(frozen=True)
class Mode:
    """How much a run measures."""

    calls: int
    warmup: int
    flood: int
    measured: int


MODES = {
    "full": Mode(calls=2000, warmup=200, flood=1000, measured=20),
    "quick": Mode(calls=500, warmup=50, flood=1000, measured=10),
    "smoke": Mode(calls=30, warmup=5, flood=100, measured=3),
}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _serve(procs: Processes, *args: str, **env: str) -> str:
    """A ``stargrpc serve`` of the bench tools with ``env`` added; its target once it
    listens."""
    port = _free_port()
    state = procs.folder / f"state-{port}"
    full = {**os.environ, "STARGRPC_STATE_DIR": str(state), "STARGRPC_LOG_LEVEL": "error",
            "STARGRPC_SHUTDOWN_GRACE_SECONDS": "1", **env}
    full.pop("STARGRPC_CONFIG", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "stargrpc.cli", "serve", "--port", str(port), "--tools-dir",
         "bench/tools", *args], cwd=ROOT, env=full, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    procs.procs.append(proc)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"stargrpc exited with status {proc.returncode}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return f"127.0.0.1:{port}"
        time.sleep(0.05)  # a process gives no event to await
    raise RuntimeError("stargrpc did not listen within 90 s")


#: ``bench_trivial`` in a lane nobody ever waits in.
_AMPLE_LANE = {"STARGRPC_LANES": json.dumps({"bench": {"max_concurrent": 1_000_000}}),
               "STARGRPC_TOOL_LANES": json.dumps({"bench_trivial": "bench"})}


def admission(mode: Mode, folder: Path) -> dict[str, float]:
    """Trivial p50 of each set-up (ms): embedded and fleet, without and with a lane."""
    procs = Processes(folder / "admission")
    procs.folder.mkdir()
    try:
        redis_port = _free_port()
        procs.redis(redis_port)
        url = f"redis://127.0.0.1:{redis_port}/0"
        targets = [
            _serve(procs, "--insecure-no-auth"),
            _serve(procs, "--insecure-no-auth", **_AMPLE_LANE),
            _serve(procs, "--insecure-no-auth", "--redis-url", url,
                   STARGRPC_REDIS_KEY_PREFIX="bench-none:"),
            _serve(procs, "--insecure-no-auth", "--redis-url", url,
                   STARGRPC_REDIS_KEY_PREFIX="bench-lane:", **_AMPLE_LANE),
        ]
        plan = [{"measure": "latency", "calls": mode.calls, "warmup": mode.warmup}]
        done = subprocess.run(
            [sys.executable, "-m", "bench.client",
             *(arg for target in targets for arg in ("--target", target)),
             "--plan", json.dumps(plan)], cwd=ROOT, capture_output=True, text=True,
            timeout=900, check=False)
    finally:
        procs.stop()
    if done.returncode != 0:
        raise RuntimeError(f"the client failed: {(done.stdout + done.stderr)[-1000:]}")
    latency = json.loads(done.stdout)["latency"]
    names = ("embedded", "embedded_lane", "fleet", "fleet_lane")
    return {name: float(figures["p50_ms"]) for name, figures in zip(names, latency,
                                                                    strict=True)}


async def _flood(target: str, flood_key: str, other_key: str, mode: Mode) -> list[float]:
    """The other principal's call times (s) while the flood waits."""
    import grpc

    from stargrpc.v1 import tool_service_pb2, tool_service_pb2_grpc

    def request() -> Any:
        call = tool_service_pb2.ExecuteRequest(tool_name="bench_wait")
        call.arguments_json = json.dumps({"ms": FLOOD_RUN_MS})
        return call

    async def run(stub: Any, key: str) -> None:
        async for response in stub.Execute(request(),
                                           metadata=(("authorization", f"Bearer {key}"),)):
            if response.event.HasField("result"):
                assert response.event.result.outcome == 1, response.event.result

    async with grpc.aio.insecure_channel(target) as flood_channel, \
            grpc.aio.insecure_channel(target) as other_channel:
        flood_stub = tool_service_pb2_grpc.ToolServiceStub(flood_channel)
        other_stub = tool_service_pb2_grpc.ToolServiceStub(other_channel)
        flood = [asyncio.ensure_future(run(flood_stub, flood_key)) for _ in range(mode.flood)]
        # Let the flood reach the server and fill the queue before the other one calls.
        await asyncio.sleep(min(2.0, mode.flood / 500))
        times = []
        for _ in range(mode.measured):
            started = time.perf_counter()
            await run(other_stub, other_key)
            times.append(time.perf_counter() - started)
        await asyncio.wait_for(asyncio.gather(*flood), 600)
    return times


def flood(mode: Mode, folder: Path) -> list[float]:
    """The other principal's call times (s) beside a flood of ``mode.flood`` calls."""
    from stargrpc.auth.keys import KeyStore

    procs = Processes(folder / "flood")
    procs.folder.mkdir()
    keys_file = procs.folder / "keys.json"
    store = KeyStore(keys_file)
    flood_key = store.create("flood", ["user"])[1]
    other_key = store.create("other", ["user"])[1]
    try:
        target = _serve(
            procs, "--keys-file", str(keys_file),
            STARGRPC_LANES=json.dumps({"bench": {"max_concurrent": 4,
                                                 "max_queued": mode.flood + 10}}),
            STARGRPC_TOOL_LANES=json.dumps({"bench_wait": "bench"}),
            STARGRPC_MAX_CONCURRENT_RUNS_PER_PRINCIPAL="0",
            STARGRPC_MAX_CONCURRENT_RUNS="0")
        return asyncio.run(_flood(target, flood_key, other_key, mode))
    finally:
        procs.stop()


def table(p50: dict[str, float], other: list[float]) -> list[str]:
    """The figures and their targets as Markdown rows."""
    embedded = p50["embedded_lane"] / p50["embedded"]
    fleet = p50["fleet_lane"] / p50["fleet"]
    waited = statistics.median(other) / (FLOOD_RUN_MS / 1000)
    rows = [
        ("trivial p50 through an empty lane, embedded (ms)",
         f"{p50['embedded_lane']:.3f} vs {p50['embedded']:.3f}", embedded, ADMISSION_TARGET),
        ("trivial p50 through an empty lane, fleet (ms)",
         f"{p50['fleet_lane']:.3f} vs {p50['fleet']:.3f}", fleet, ADMISSION_TARGET),
        ("the other principal's p50 beside a flood of one (ms)",
         f"{statistics.median(other) * 1000:.1f} vs run {FLOOD_RUN_MS:g}", waited, FLOOD_TARGET),
    ]
    lines = ["| figure | measured | ratio | target | met |", "|---|---|---|---|---|"]
    lines += [f"| {name} | {measured} | {ratio:.3f}x | ≤ {target:g}x | "
              f"{'yes' if ratio <= target else 'no'} |"
              for name, measured, ratio, target in rows]
    return lines


def main(argv: list[str] | None = None) -> int:
    """Measures both cases and prints the table."""
    parser = argparse.ArgumentParser(prog="python -m bench.lanes", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="a reduced pass")
    size.add_argument("--smoke", action="store_true", help="the tiniest pass (the test's)")
    args = parser.parse_args(argv)
    mode = MODES["smoke" if args.smoke else "quick" if args.quick else "full"]
    with tempfile.TemporaryDirectory(prefix="bench-lanes-") as folder:
        p50 = admission(mode, Path(folder))
        other = flood(mode, Path(folder))
    print(f"lanes: {mode.calls} sequential trivial calls per set-up, in turns; "
          f"{mode.flood} flooding calls of a {FLOOD_RUN_MS:g} ms run in a lane of 4 slots "
          f"beside {mode.measured} of another principal's")
    print("\n".join(table(p50, other)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
