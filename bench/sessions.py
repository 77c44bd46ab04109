"""Session call latency: ``python -m bench.sessions [--calls N]``.

Starts one stargrpc server in this process (bundled tools, no authentication, the
sandbox's isolation as detected here) and times, through the Python SDK, sequential calls
of ``python`` ``print(1)``:

- **session**: inside one session (its interpreter already running);
- **one-off**: without a session (a fresh sandbox and interpreter per call);
- **session create**: CreateSession until its interpreter is ready;
- **echo**: the bundled ``echo`` tool, no sandbox (the floor of a call through the SDK).

Prints p50 and p95 of each, in milliseconds. Reported, never asserted: the machine is
shared and noisy (see ``bench/README.md``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

from stargrpc.client import AsyncClient
from stargrpc.server.grpc_server import StargrpcServer
from stargrpc.settings import Settings


async def _timed(calls: int, warmup: int, once: Callable[[], Awaitable[object]]
                 ) -> list[float]:
    for _ in range(warmup):
        await once()
    taken = []
    for _ in range(calls):
        started = time.perf_counter()
        await once()
        taken.append((time.perf_counter() - started) * 1000)
    return taken


def _line(name: str, taken: list[float]) -> str:
    ordered = sorted(taken)
    p95 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))]
    return (f"| {name} | {statistics.median(ordered):.1f} | {p95:.1f} | {len(ordered)} |")


async def measure(calls: int, warmup: int = 3) -> list[str]:
    """The table's lines: p50 and p95 of each kind of call, in milliseconds."""
    with tempfile.TemporaryDirectory() as state:
        settings = Settings.load(host="127.0.0.1", port=0, insecure_no_auth=True,
                                 log_level="warning", state_dir=Path(state))
        server = StargrpcServer(settings)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                client = AsyncClient(channel)
                session = await client.create_session("python")
                code = {"code": "print(1)"}

                async def in_session() -> object:
                    result = await client.call("python", code, session_id=session.session_id)
                    if result.output != "1":
                        raise RuntimeError(f"python in a session printed {result.output!r}")
                    return result

                async def one_off() -> object:
                    return await client.call("python", code)

                async def create() -> object:
                    made = await client.create_session("python")
                    await client.close_session(made.session_id)
                    return made

                async def echo() -> object:
                    return await client.call("echo", {"text": "1"})

                return [
                    "| call | p50 ms | p95 ms | calls |", "|---|---|---|---|",
                    _line("python print(1) in a session", await _timed(calls, warmup,
                                                                         in_session)),
                    _line("python print(1), one-off sandbox", await _timed(calls, warmup,
                                                                             one_off)),
                    _line("CreateSession (python) + CloseSession",
                          await _timed(max(calls // 5, 3), 1, create)),
                    _line("echo (no sandbox)", await _timed(calls, warmup, echo)),
                ]
        finally:
            await server.stop(grace=1.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sessions",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=25, help="Timed calls of each kind.")
    args = parser.parse_args(argv)
    for line in asyncio.run(measure(args.calls)):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
