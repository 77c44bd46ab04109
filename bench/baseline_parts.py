"""``python -m bench.baseline_parts``: where a bare grpc.aio call's time goes, part by part.

A minimal grpc.aio pair — a server of one generic method answering raw bytes (START, END,
RESULT as three small messages) and a client reading them as raw bytes on one channel, no
metadata, no deadline — and, one lane at a time, what the benchmark's bare baseline adds
to it: stargrpc's contract messages (``stargrpc.v1`` ExecuteRequest / RunEvents built per
message, ``bench/baseline_server.py``), the server's collector settings, the API key's
metadata, a deadline, the bench client's per-call work (a request built per call, every
response parsed, sized and checked: ``bench/client.py`` before it was made lean), the
client process's weight (the bench client imports the peers' SDKs), the client's collector,
and several servers taking turns call by call. Every lane runs in every round, the lanes'
order rotating by one each round, each client process in turn (the light one imports grpc
and the generated code only; the heavy one ``bench.client``): the machine's noise falls on
all alike, and each step's cost is the median of its round-by-round differences.

    python -m bench.baseline_parts                # trivial calls: p50 and server CPU per call
    python -m bench.baseline_parts --shape wait   # rounds of 200 concurrent 10 ms calls
    python -m bench.baseline_parts --shape stream # one stream of deltas, messages/s

Bounded: a fixed number of rounds and calls, every call under a deadline or a timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc

RAW_METHOD = "/bench.Minimal/Run"
EXECUTE = "/stargrpc.v1.ToolService/Execute"
#: No call of this harness may take longer, whatever the machine is doing.
CALL_TIMEOUT = 60.0


# -- the servers ---------------------------------------------------------------------------

async def _raw_run(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    """The minimal method: b"t" trivial, b"w" a 10 ms wait, b"s<n>" n deltas."""
    yield b"START"
    if request[:1] == b"w":
        await asyncio.sleep(0.01)
    elif request[:1] == b"s":
        for i in range(1, int(request[1:]) + 1):
            yield b"%07d\n" % i
    yield b"END"
    yield b"RESULT"


def _prebuilt() -> list[bytes]:
    """One trivial call's three RunEvents as ``bench/baseline_server.py`` builds them,
    serialised once: the contract's bytes without the work of building them."""
    from bench import baseline_server

    events = baseline_server._Events("bench_trivial")
    return [m.SerializeToString() for m in (events.start(), events.end(), events.result(""))]


async def _prebuilt_run(request: bytes, context: grpc.aio.ServicerContext
                        ) -> AsyncIterator[bytes]:
    """The contract's method answering the same three prebuilt messages to every call."""
    for message in PREBUILT:
        yield message


PREBUILT: list[bytes] = []


async def _serve(kind: str, tuned_gc: bool) -> None:
    from bench import baseline_server

    server = grpc.aio.server()
    if kind == "raw":
        handler = grpc.method_handlers_generic_handler(
            "bench.Minimal", {"Run": grpc.unary_stream_rpc_method_handler(_raw_run)})
    elif kind == "prebuilt":
        PREBUILT.extend(_prebuilt())
        handler = grpc.method_handlers_generic_handler("stargrpc.v1.ToolService", {
            "Execute": grpc.unary_stream_rpc_method_handler(_prebuilt_run)})
    else:
        handler = grpc.method_handlers_generic_handler("stargrpc.v1.ToolService", {
            "Execute": grpc.unary_stream_rpc_method_handler(
                baseline_server.execute,
                request_deserializer=tool_service_pb2.ExecuteRequest.FromString,
                response_serializer=tool_service_pb2.ExecuteResponse.SerializeToString)})
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    if tuned_gc:
        gc.collect()
        gc.freeze()
        gc.set_threshold(5_000, 20, 20)
    print(json.dumps({"event": "serving", "address": f"127.0.0.1:{port}"}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(0.5)


# -- the client ----------------------------------------------------------------------------

def _cpu(pid: int) -> float:
    """Seconds on a CPU of all of a process's threads, to the nanosecond (schedstat: the
    clock ticks of /proc/PID/stat are 10 ms, too coarse for a block of calls)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError):  # a thread that ended meanwhile
            continue
    return total / 1e9


def _request(kind: str, shape: str, n: int) -> bytes:
    if kind == "raw":
        return {"trivial": b"t", "wait": b"w", "stream": b"s%d" % n}[shape]
    tool, arguments = {"trivial": ("bench_trivial", {}), "wait": ("bench_wait", {"ms": 10.0}),
                       "stream": ("bench_stream", {"n": n})}[shape]
    return tool_service_pb2.ExecuteRequest(
        tool_name=tool, arguments_json=json.dumps(arguments)).SerializeToString()


class Lane:
    """One way of calling one server (or several, taking turns call by call)."""

    def __init__(self, spec: dict[str, Any], addresses: dict[str, str], token: str,
                 shape: str, n: int) -> None:
        self.spec = spec
        self.shape = shape
        self.n = n
        self.client = spec["client"]
        servers = spec["servers"]
        self.kind = "raw" if servers[0].startswith("raw") else "contract"
        self.channels = [grpc.aio.insecure_channel(addresses[s]) for s in servers]
        self.metadata = (("authorization", f"Bearer {token}"),) if spec.get("metadata") else None
        self.timeout = CALL_TIMEOUT if spec.get("deadline") else None
        method = RAW_METHOD if self.kind == "raw" else EXECUTE
        self.raw = [c.unary_stream(method) for c in self.channels]
        self.stubs = [tool_service_pb2_grpc.ToolServiceStub(c) for c in self.channels]
        self.request = _request(self.kind, shape, n)
        self.arguments = {"trivial": {}, "wait": {"ms": 10.0}, "stream": {"n": n}}[shape]
        self.tool = {"trivial": "bench_trivial", "wait": "bench_wait",
                     "stream": "bench_stream"}[shape]
        self.bench: list[Any] = []
        if self.client in ("legacy", "lean"):
            from bench.client import Client, LegacyClient

            kind = LegacyClient if self.client == "legacy" else Client
            self.bench = [kind(addresses[s], token if spec.get("metadata") else "")
                          for s in servers]
        self.turn = 0
        #: Calls each server takes before the next one's turn (1: call by call).
        self.per_turn = int(spec.get("per_turn", 1))
        self.calls_made = 0

    async def call(self) -> int:
        """One call to its last message; the messages it delivered."""
        k = (self.calls_made // self.per_turn) % len(self.channels)
        self.calls_made += 1
        if self.client == "raw":
            count = 0
            async for _ in self.raw[k](self.request, metadata=self.metadata,
                                       timeout=self.timeout):
                count += 1
            return count
        if self.bench:
            done = await self.bench[k].execute(self.tool, self.arguments,
                                               expect_messages=None if self.shape == "stream"
                                               else 3)
            return done.messages
        # "stub": the bench client's work before it was made lean, step by step.
        request = tool_service_pb2.ExecuteRequest(tool_name=self.tool,
                                                  arguments_json=json.dumps(self.arguments))
        count = wire = 0
        last = None
        async for response in self.stubs[k].Execute(request, metadata=self.metadata,
                                                     timeout=self.timeout):
            count += 1
            wire += response.ByteSize()
            last = response
        if last is None or not last.event.HasField("result") or \
                last.event.result.outcome != events_pb2.OUTCOME_OK:
            raise RuntimeError("no Result")
        return count

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()
        for client in self.bench:
            await client.close()


class _Collector:
    """The client's collector as a lane wants it, switched around each of its blocks."""

    def __init__(self, tuned: bool) -> None:
        self.tuned = tuned

    def __enter__(self) -> None:
        if self.tuned:
            gc.freeze()  # moves what is tracked to the permanent generation: O(1)
            gc.set_threshold(5_000, 20, 20)

    def __exit__(self, *exc: object) -> None:
        if self.tuned:
            gc.unfreeze()
            gc.set_threshold(700, 10, 10)


async def _trivial(lanes: list[Lane], calls: int, warmup: int, block: int, round_: int,
                   pids: dict[str, int]) -> dict[str, Any]:
    """Sequential trivial calls, the lanes taking turns ``block`` calls at a time (the
    order rotating each turn), so that the noise of the moment falls on every lane."""
    for lane in lanes:
        with _Collector(lane.spec.get("client_gc") == "tuned"):
            for _ in range(warmup):
                await lane.call()
    seconds: list[list[float]] = [[] for _ in lanes]
    cpu = [0.0 for _ in lanes]
    for turn in range((calls + block - 1) // block):
        for k in ((round_ + turn + j) % len(lanes) for j in range(len(lanes))):
            lane = lanes[k]
            mine = [pids[s] for s in lane.spec["servers"]]
            with _Collector(lane.spec.get("client_gc") == "tuned"):
                before = sum(_cpu(pid) for pid in mine)
                for _ in range(block):
                    started = time.perf_counter()
                    await lane.call()
                    seconds[k].append(time.perf_counter() - started)
                cpu[k] += sum(_cpu(pid) for pid in mine) - before
    return {lane.spec["name"]: {"p50_ms": statistics.median(s) * 1e3,
                                "cpu_us_per_call": c / len(s) * 1e6}
            for lane, s, c in zip(lanes, seconds, cpu, strict=True)}


async def _measure(lane: Lane, concurrent: int) -> dict[str, Any]:
    with _Collector(lane.spec.get("client_gc") == "tuned"):
        await lane.call()  # warm-up
        if lane.shape == "wait":
            started = time.perf_counter()
            await asyncio.gather(*(lane.call() for _ in range(concurrent)))
            return {"calls_per_s": concurrent / (time.perf_counter() - started)}
        started = time.perf_counter()
        messages = await lane.call()
        return {"msgs_per_s": messages / (time.perf_counter() - started)}


async def _client(args: argparse.Namespace) -> None:
    if args.heavy:
        import bench.client  # noqa: F401  (the bench client's imports: the peers' SDKs)
    addresses = json.loads(args.addresses)
    pids = json.loads(args.pids)
    specs = json.loads(args.lanes)
    lanes = [Lane(spec, addresses, os.environ.get("BENCH_TOKEN", "x"), args.shape, args.n)
             for spec in specs]
    found: dict[str, Any] = {}
    try:
        if args.shape == "trivial":
            found = await asyncio.wait_for(_trivial(lanes, args.calls, args.warmup,
                                                    args.block, args.round, pids), 240)
        else:
            runs: dict[str, list[float]] = {lane.spec["name"]: [] for lane in lanes}
            for repeat in range(args.repeats):
                for k in ((args.round + repeat + j) % len(lanes) for j in range(len(lanes))):
                    figures = await asyncio.wait_for(_measure(lanes[k], args.concurrent), 120)
                    runs[lanes[k].spec["name"]].append(next(iter(figures.values())))
            key = "calls_per_s" if args.shape == "wait" else "msgs_per_s"
            found = {name: {key: statistics.median(values)} for name, values in runs.items()}
    finally:
        for lane in lanes:
            await lane.close()
    print(json.dumps(found))


# -- the orchestrator ----------------------------------------------------------------------

#: Each step adds one difference to the step before it (``vs``); the light client process
#: imports grpc and the generated code only, the heavy one ``bench.client`` too.
_OTHERS = [f"ct{k}" for k in range(1, 8)]
STEPS: list[dict[str, Any]] = [
    {"name": "minimal pair", "servers": ["raw"], "client": "raw", "process": "light"},
    {"name": "+ the contract's bytes (one trivial call's RunEvents, serialised once)",
     "servers": ["prebuilt"], "client": "raw", "process": "light", "vs": "minimal pair"},
    {"name": "+ the contract's messages (ExecuteRequest, RunEvents built per message)",
     "servers": ["contract"], "client": "raw", "process": "light",
     "vs": "+ the contract's bytes (one trivial call's RunEvents, serialised once)"},
    {"name": "+ the server's collector settings (freeze, 5000/20/20)",
     "servers": ["ct0"], "client": "raw", "process": "light",
     "vs": "+ the contract's messages (ExecuteRequest, RunEvents built per message)"},
    {"name": "+ the API key's metadata", "servers": ["ct0"], "client": "raw",
     "metadata": True, "process": "light",
     "vs": "+ the server's collector settings (freeze, 5000/20/20)"},
    {"name": "+ a 60 s deadline", "servers": ["ct0"], "client": "raw", "metadata": True,
     "deadline": True, "process": "light", "vs": "+ the API key's metadata"},
    {"name": "+ the client's per-call work (request built, responses parsed, sized, checked)",
     "servers": ["ct0"], "client": "stub", "metadata": True, "deadline": True,
     "process": "light", "vs": "+ a 60 s deadline"},
    {"name": "+ the old bench client, in its heavy process (the peers' SDKs imported)",
     "servers": ["ct0"], "client": "legacy", "metadata": True, "process": "heavy",
     "vs": "+ the client's per-call work (request built, responses parsed, sized, checked)"},
    {"name": "  (the same, the client's collector frozen and 5000/20/20)",
     "servers": ["ct0"], "client": "legacy", "metadata": True, "process": "heavy",
     "client_gc": "tuned",
     "vs": "+ the old bench client, in its heavy process (the peers' SDKs imported)"},
    {"name": "+ eight servers taking turns call by call: the old baseline",
     "servers": ["ct0", *_OTHERS], "client": "legacy", "metadata": True, "process": "heavy",
     "vs": "+ the old bench client, in its heavy process (the peers' SDKs imported)"},
    {"name": "  (eight servers taking turns 10 calls at a time)",
     "servers": ["ct0", *_OTHERS], "client": "legacy", "metadata": True, "process": "heavy",
     "per_turn": 10,
     "vs": "+ the old bench client, in its heavy process (the peers' SDKs imported)"},
    {"name": "the new baseline: the lean client (collector tuned), turns of 10 calls",
     "servers": ["ct0", *_OTHERS], "client": "lean", "metadata": True, "process": "heavy",
     "per_turn": 10, "client_gc": "tuned", "vs": "minimal pair"},
    {"name": "  the new baseline against the old",
     "servers": ["ct0", *_OTHERS], "client": "lean", "metadata": True, "process": "heavy",
     "per_turn": 10, "client_gc": "tuned",
     "vs": "+ eight servers taking turns call by call: the old baseline"},
]


def _one_server_steps() -> list[dict[str, Any]]:
    """The steps for the concurrency and stream shapes, whose turns in the bench are round
    by round or run by run: each on one server; the old baseline is the old client's."""
    old = "+ eight servers taking turns call by call: the old baseline"
    steps = []
    for step in STEPS:
        if "new baseline" in step["name"]:
            step = {**step, "servers": ["ct0"], "per_turn": 1}
        elif len(step["servers"]) > 1 or step["servers"] == ["prebuilt"]:
            continue  # (the prebuilt server answers every call as a trivial one)
        if step.get("vs") == "+ the contract's bytes (one trivial call's RunEvents, " \
                "serialised once)":
            step = {**step, "vs": "minimal pair"}
        if step.get("vs") == old:
            step = {**step, "vs": "+ the old bench client, in its heavy process (the peers' "
                                  "SDKs imported)"}
        steps.append(step)
    return steps


def _server_specs() -> list[Any]:
    from bench.__main__ import ServerSpec, baseline_argv

    me = [sys.executable, "-m", "bench.baseline_parts", "--serve"]
    specs = [ServerSpec("raw", [*me, "raw"], dict(os.environ)),
             ServerSpec("prebuilt", [*me, "prebuilt"], dict(os.environ)),
             ServerSpec("contract", [*me, "contract"], dict(os.environ))]
    specs += [ServerSpec(f"ct{k}", baseline_argv(), dict(os.environ)) for k in range(8)]
    return specs


def _summary(values: list[float]) -> str:
    ordered = sorted(values)
    q1 = ordered[len(ordered) // 4]
    q3 = ordered[(3 * len(ordered)) // 4]
    return f"{statistics.median(values):+.0f} ({q1:+.0f} to {q3:+.0f})"


def orchestrate(args: argparse.Namespace) -> None:
    from bench.__main__ import servers

    figure = {"trivial": "p50_ms", "wait": "calls_per_s", "stream": "msgs_per_s"}[args.shape]
    scale = 1e3 if args.shape == "trivial" else 1.0  # ms → µs
    steps = STEPS if args.shape == "trivial" else _one_server_steps()
    samples: dict[str, list[dict[str, Any]]] = {s["name"]: [] for s in steps}
    with tempfile.TemporaryDirectory(prefix="bench-parts-") as tmp, \
            servers(_server_specs(), Path(tmp)) as running:
        addresses = {s.name: s.address for s in running}
        pids = {s.name: s.pid for s in running}
        for r in range(args.rounds):
            processes = ["light", "heavy"] if r % 2 == 0 else ["heavy", "light"]
            for process in processes:
                lanes = [s for s in steps if s["process"] == process]
                argv = [sys.executable, "-m", "bench.baseline_parts", "--client",
                        "--addresses", json.dumps(addresses), "--pids", json.dumps(pids),
                        "--lanes", json.dumps(lanes), "--shape", args.shape,
                        "--calls", str(args.calls), "--warmup", str(args.warmup),
                        "--n", str(args.n), "--block", str(args.block),
                        "--concurrent", str(args.concurrent), "--repeats", str(args.repeats),
                        "--round", str(r)] + (["--heavy"] if process == "heavy" else [])
                done = subprocess.run(argv, capture_output=True, text=True, timeout=300,
                                      check=False)
                if done.returncode != 0:
                    raise SystemExit(f"client failed: {done.stderr[-2000:]}")
                for name, value in json.loads(done.stdout.strip().splitlines()[-1]).items():
                    samples[name].append(value)
            print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
    load = os.getloadavg()
    unit = {"trivial": "p50, µs", "wait": "calls/s", "stream": "msgs/s"}[args.shape]
    print(f"{args.rounds} rounds; load average at the end {load[0]:.2f}, {load[1]:.2f}, "
          f"{load[2]:.2f}")
    head = f"| step | {unit} (median of rounds) | step's difference, median (quartiles) |"
    if args.shape == "trivial":
        head += " server CPU µs/call | CPU difference |"
    print(head)
    print("|---|---:|---:|" + ("---:|---:|" if args.shape == "trivial" else ""))
    result: dict[str, Any] = {}
    for step in steps:
        mine = [v[figure] * scale for v in samples[step["name"]]]
        row = f"| {step['name']} | {statistics.median(mine):,.0f} | "
        if "vs" in step:
            base = [v[figure] * scale for v in samples[step["vs"]]]
            row += _summary([a - b for a, b in zip(mine, base, strict=True)]) + " |"
        else:
            row += "— |"
        if args.shape == "trivial":
            cpu = [v["cpu_us_per_call"] for v in samples[step["name"]]]
            row += f" {statistics.median(cpu):.0f} | "
            if "vs" in step:
                base_cpu = [v["cpu_us_per_call"] for v in samples[step["vs"]]]
                row += _summary([a - b for a, b in zip(cpu, base_cpu, strict=True)]) + " |"
            else:
                row += "— |"
        print(row)
        result[step["name"]] = samples[step["name"]]
    print(json.dumps({"shape": args.shape, "load_average": load, "samples": result}),
          file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.baseline_parts", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve", choices=("raw", "prebuilt", "contract"))
    parser.add_argument("--tuned-gc", action="store_true")
    parser.add_argument("--client", action="store_true")
    parser.add_argument("--heavy", action="store_true")
    parser.add_argument("--addresses", default="{}")
    parser.add_argument("--pids", default="{}")
    parser.add_argument("--lanes", default="[]")
    parser.add_argument("--round", type=int, default=0)
    parser.add_argument("--shape", choices=("trivial", "wait", "stream"), default="trivial")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--block", type=int, default=10,
                        help="trivial calls per lane per turn")
    parser.add_argument("--n", type=int, default=5000, help="deltas per stream")
    parser.add_argument("--concurrent", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3,
                        help="wait and stream: each lane's figure is the median of this many, "
                             "the lanes in turns")
    args = parser.parse_args(argv)
    if args.serve:
        asyncio.run(_serve(args.serve, args.tuned_gc))
    elif args.client:
        asyncio.run(_client(args))
    else:
        if args.shape != "trivial":
            args.warmup = min(args.warmup, 1)
        orchestrate(args)


if __name__ == "__main__":
    main()
