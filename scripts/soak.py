"""Bounded soak test: many calls against a real ``stargrpc serve`` process, watching its memory.

Starts a server on a free loopback port (in-process run store by default, ``--redis-url`` for
the Redis store), then runs ``--calls`` Executes (default 20,000) ``--concurrency`` at a time:
a mix of echo, count, idempotent repeats and WatchRun replays. Every ``--sample-every`` calls
it records the server's resident memory (VmRSS). It stops at the call count or after
``--max-seconds``, whichever comes first, prints the samples, and exits non-zero when a call
failed or memory still grew over the last quarter of the run (more than ``--max-growth``).

Memory is expected to rise while the finished-run store fills (up to ``max_finished_runs``,
10,000 by default, or ``run_retention_seconds``) and then settle. Not part of the test suite::

    .venv/bin/python scripts/soak.py                   # 20,000 calls, memory store
    .venv/bin/python scripts/soak.py --calls 5000 --redis-url redis://127.0.0.1:6379/0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import grpc

from stargrpc.v1 import tool_service_pb2, tool_service_pb2_grpc


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def _start_server(state_dir: Path, redis_url: str) -> tuple[subprocess.Popen[str], int]:
    env = dict(os.environ, STARGRPC_STATE_DIR=str(state_dir), STARGRPC_INSECURE_NO_AUTH="true",
               STARGRPC_LOG_LEVEL="warning")
    # The soak itself runs more than the default per-principal limit at once.
    env.setdefault("STARGRPC_MAX_CONCURRENT_RUNS_PER_PRINCIPAL", "0")
    if redis_url:
        env["STARGRPC_REDIS_URL"] = redis_url
        env["STARGRPC_REDIS_KEY_PREFIX"] = f"stargrpc-soak:{uuid.uuid4().hex[:8]}:"
    proc = subprocess.Popen(
        [sys.executable, "-m", "stargrpc.cli", "serve", "--host", "127.0.0.1", "--port", "0",
         "--log-format", "json", "--log-level", "info"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    for raw in proc.stdout:
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        if line.get("event") == "serving":
            # Keep draining its output so the pipe never fills and blocks the server.
            asyncio.get_running_loop().run_in_executor(None, proc.stdout.read)
            return proc, int(str(line["address"]).rsplit(":", 1)[1])
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise SystemExit("the server did not start")


def _request(i: int) -> tool_service_pb2.ExecuteRequest:
    kind = i % 4
    args: dict[str, object]
    if kind == 0:
        args, key = {"text": f"soak {i}"}, ""
    elif kind == 1:
        args, key = {"to": 5}, ""
    else:  # keyed: every other keyed call repeats the previous key (a replay)
        args, key = {"text": "keyed"}, f"soak-{i // 2}"
    request = tool_service_pb2.ExecuteRequest(tool_name="count" if kind == 1 else "echo",
                                              idempotency_key=key)
    request.arguments_json = json.dumps(args)
    return request


async def _soak(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="stargrpc-soak-") as state:
        proc, port = _start_server(Path(state), args.redis_url)
        try:
            return await _drive(args, proc, port)
        finally:
            proc.terminate()
            proc.wait(30)


async def _drive(args: argparse.Namespace, proc: subprocess.Popen[str], port: int) -> int:
    failures = 0
    done = 0
    samples: list[tuple[int, float, int]] = [(0, 0.0, _rss_bytes(proc.pid))]
    started = time.monotonic()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = tool_service_pb2_grpc.ToolServiceStub(channel)

        async def one(i: int) -> None:
            nonlocal failures
            try:
                last = None
                async for response in stub.Execute(_request(i), timeout=60):
                    last = response.event
                if last is None or not last.HasField("result"):
                    failures += 1
                elif i % 50 == 0:  # now and then, replay the run through WatchRun
                    watch = tool_service_pb2.WatchRunRequest(run_id=last.run_id)
                    count = len([r async for r in stub.WatchRun(watch, timeout=60)])
                    failures += count != last.seq
            except grpc.aio.AioRpcError as error:
                failures += 1
                if failures <= 5:
                    print(f"call {i} failed: {error.code().name}: {error.details()}")

        while done < args.calls and time.monotonic() - started < args.max_seconds:
            batch = min(args.concurrency, args.calls - done)
            await asyncio.gather(*(one(done + i) for i in range(batch)))
            done += batch
            if done % args.sample_every < batch or done == args.calls:
                samples.append((done, time.monotonic() - started, _rss_bytes(proc.pid)))
    return _report(args, samples, failures)


def _report(args: argparse.Namespace, samples: list[tuple[int, float, int]],
            failures: int) -> int:
    mib = 1024 * 1024
    print(f"{'calls':>8} {'seconds':>8} {'rss MiB':>8}")
    for calls, seconds, rss in samples:
        print(f"{calls:>8} {seconds:>8.1f} {rss / mib:>8.1f}")
    total, elapsed = samples[-1][0], samples[-1][1]
    # The finished-run store fills first (memory rises), then holds steady: judge the end.
    quarter = samples[len(samples) * 3 // 4:]
    start = quarter[0][2]
    growth = (max(rss for _, _, rss in quarter) - start) / start if start else 0.0
    print(f"{total} calls in {elapsed:.0f} s ({total / max(elapsed, 1e-9):.0f}/s), "
          f"{failures} failed; memory over the last quarter grew {growth:.1%} "
          f"(limit {args.max_growth:.0%}), peak {max(r for _, _, r in samples) / mib:.0f} MiB")
    return 1 if failures or growth > args.max_growth else 0


def main() -> None:
    """Parse arguments and run the soak."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--max-seconds", type=float, default=600.0)
    parser.add_argument("--sample-every", type=int, default=1000)
    parser.add_argument("--max-growth", type=float, default=0.05,
                        help="allowed RSS growth over the last quarter (fraction)")
    parser.add_argument("--redis-url", default="", help="use the Redis run store")
    sys.exit(asyncio.run(_soak(parser.parse_args())))


if __name__ == "__main__":
    main()
