"""The benchmark client: the SAME code drives stargrpc, the bare baseline and the peers.

It runs a plan of measurements against one or more servers over one channel each, the
servers taking turns call by call (or run by run), so that the noise of a shared machine
falls on all of them alike; it prints the figures as one JSON object::

    python -m bench.client --target 127.0.0.1:A --target 127.0.0.1:B \\
        --plan '[{"measure": "latency", "calls": 2000, "warmup": 200}]'

A target is a gRPC server (``127.0.0.1:PORT``; ``grpc*N:127.0.0.1:PORT`` spreads the calls
over N channels, each its own connection, for a server whose processes share the port;
``legacy:127.0.0.1:PORT`` drives it with the client as it was before issue 31), the
seed-design peer (``seed:REDIS_URL#PREFIX``, :mod:`bench.seed_peer`) or the MCP peer
(``mcp:URL``, :mod:`bench.mcp`, driven by the official SDK's client). A plan step's
``targets`` (indices into the ``--target`` list) names the servers it measures; by default
all of them.

Measures: latency (calls, warmup, block), stream (n, runs, slow_every, slow_ms, coalesce,
server_pids, coalesce_deltas), concurrency (concurrent, rounds, ms, count_errors), held
(streams, seconds, server_pids, open_timeout), cpu (calls, warmup, server_pids, block).
The peers take part in latency, concurrency and cpu; the MCP peer in stream too (its tool
reports progress); held and the slow reader are gRPC's.

It runs in its own process (the orchestrator, ``python -m bench``, starts it), so client and
server never share an interpreter. Every loop is bounded in count and in time, and the only
address ever used is the ``--target`` on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from bench.mcp import McpPeerClient
from bench.seed_peer import SeedCaller, parse_address
from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc

#: Width of one streamed delta, as the benchmark tools send them ("0000001\n").
DELTA_WIDTH = 8
#: No single call may take longer than this, whatever the machine is doing.
CALL_TIMEOUT = 60.0
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_CAN_COALESCE = "coalesce_deltas" in tool_service_pb2.ExecuteRequest.DESCRIPTOR.fields_by_name
_PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024


class BenchError(RuntimeError):
    """A call did not produce what the benchmark expects."""


#: Calls made a second time after UNAVAILABLE, by the server's reason (printed with the
#: figures, so that a run that needed them says so).
RETRIES: dict[str, int] = {}


@dataclass
class Call:
    """What one Execute delivered."""

    seconds: float
    messages: int
    wire_bytes: int
    result: Any  # events_pb2.Result over gRPC, the peer's own reply otherwise


def server_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def server_rss_kb(pid: int) -> int:
    """Resident set size of a process in KiB, from /proc."""
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE_KB


def percentile(values: Sequence[float], share: float) -> float:
    """The value below which ``share`` of ``values`` lie (nearest rank)."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(share * len(ordered)) - 1))
    return ordered[rank]


#: The one method every gRPC target serves.
EXECUTE = "/stargrpc.v1.ToolService/Execute"


class Client:
    """One channel to one server (or ``channels`` of them, each its own connection, taking
    the calls in turn), and the Execute calls the measurements make.

    The leanest client that still checks what it measures (the per-call costs it avoids are
    in bench/README.md, "The baseline, part by part"): a call's request is serialised once
    per tool and arguments, the responses arrive as bytes, and only the last one is parsed —
    the Result, whose outcome is checked; the messages are counted and their bytes summed.
    The same work for every server, so it adds the same to each call and nothing to one.
    Streams parse every message: each delta is checked.
    """

    def __init__(self, target: str, token: str = "", channels: int = 1) -> None:
        # Many streams on one connection: lift the client's own per-connection limits so the
        # server, not the client, is what is measured. A local subchannel pool gives each
        # channel a connection of its own, which the kernel hands to one of the processes
        # sharing the port (SO_REUSEPORT).
        options: list[tuple[str, Any]] = [("grpc.max_receive_message_length", 64 * 1024 * 1024)]
        if channels > 1:
            options.append(("grpc.use_local_subchannel_pool", 1))
        self.channels = [grpc.aio.insecure_channel(target, options=options)
                         for _ in range(max(1, channels))]
        self.stubs = [tool_service_pb2_grpc.ToolServiceStub(c) for c in self.channels]
        # No serialisers: the request goes as the bytes made once, responses come as bytes.
        self.raw = [c.unary_stream(EXECUTE) for c in self.channels]
        self._next = 0
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._requests: dict[tuple[str, str], bytes] = {}

    def _turn(self) -> int:
        k = self._next
        self._next = (k + 1) % len(self.channels)
        return k

    @property
    def stub(self) -> tool_service_pb2_grpc.ToolServiceStub:
        return self.stubs[self._turn()]

    def start(self, tool_name: str, arguments: dict[str, Any] | None = None,
              timeout: float = CALL_TIMEOUT, coalesce_deltas: bool = False) -> Any:
        """Starts an Execute call and returns it unread, its responses parsed;
        ``coalesce_deltas`` opts in to DELTA coalescing under backpressure where the contract
        has it (the bare baseline ignores it)."""
        request = tool_service_pb2.ExecuteRequest(tool_name=tool_name,
                                                  arguments_json=json.dumps(arguments or {}))
        if coalesce_deltas and _CAN_COALESCE:
            request.coalesce_deltas = True
        return self.stub.Execute(request, metadata=self.metadata, timeout=timeout)

    def _request(self, tool_name: str, arguments: dict[str, Any] | None) -> bytes:
        key = (tool_name, json.dumps(arguments or {}))
        found = self._requests.get(key)
        if found is None:
            found = self._requests[key] = tool_service_pb2.ExecuteRequest(
                tool_name=tool_name, arguments_json=key[1]).SerializeToString()
        return found

    async def execute(self, tool_name: str, arguments: dict[str, Any] | None = None,
                      expect_messages: int | None = None,
                      rpc_timeout: float = CALL_TIMEOUT) -> Call:
        """Runs one call to its Result. A call refused with UNAVAILABLE before its first
        message ("retry shortly": a shared Redis that lost its connections) is made once
        more, as a client following that advice would; the time of both counts, and
        :data:`RETRIES` counts them."""
        request = self._request(tool_name, arguments)
        started = time.perf_counter()
        messages = wire = 0
        last = b""
        for attempt in range(2):
            try:
                async for data in self.raw[self._turn()](request, metadata=self.metadata,
                                                          timeout=rpc_timeout):
                    messages += 1
                    wire += len(data)
                    last = data
                break
            except grpc.aio.AioRpcError as exc:
                if attempt or messages or exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                RETRIES[exc.details() or "UNAVAILABLE"] = RETRIES.get(
                    exc.details() or "UNAVAILABLE", 0) + 1
        seconds = time.perf_counter() - started
        event = tool_service_pb2.ExecuteResponse.FromString(last).event if messages else None
        return Call(seconds, messages, wire,
                    _checked_result(tool_name, event, messages, expect_messages))

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()


def _checked_result(tool_name: str, event: Any, messages: int,
                    expect_messages: int | None) -> Any:
    """The Result a call's last event holds, once checked: an OK outcome, the messages
    expected."""
    if event is None or not event.HasField("result"):
        raise BenchError(f"{tool_name}: the stream ended without a Result")
    if event.result.outcome != events_pb2.OUTCOME_OK:
        raise BenchError(f"{tool_name}: outcome {event.result.outcome} "
                         f"{event.result.error.message}")
    if expect_messages is not None and messages != expect_messages:
        raise BenchError(f"{tool_name}: {messages} messages, expected {expect_messages}")
    return event.result


class LegacyClient(Client):
    """The bench client as it was before issue 31 (``legacy:ADDRESS``): a request built per
    call, every response parsed by the stub and sized with ``ByteSize``. It drives the old
    baseline's column, kept for one run so that the change of baseline is visible."""

    async def execute(self, tool_name: str, arguments: dict[str, Any] | None = None,
                      expect_messages: int | None = None,
                      rpc_timeout: float = CALL_TIMEOUT) -> Call:
        started = time.perf_counter()
        messages = wire = 0
        last = None
        async for response in self.start(tool_name, arguments, rpc_timeout):
            messages += 1
            wire += response.ByteSize()
            last = response
        seconds = time.perf_counter() - started
        return Call(seconds, messages, wire, _checked_result(
            tool_name, None if last is None else last.event, messages, expect_messages))


class SeedPeer:
    """The seed-design peer through the same measurements: one reply per call."""

    def __init__(self, address: str) -> None:
        self.caller = SeedCaller(*parse_address(address))

    async def execute(self, tool_name: str, arguments: dict[str, Any] | None = None,
                      expect_messages: int | None = None,
                      rpc_timeout: float = CALL_TIMEOUT) -> Call:
        started = time.perf_counter()
        reply = await self.caller.call(tool_name, arguments, rpc_timeout)
        seconds = time.perf_counter() - started
        if "error" in reply:
            raise BenchError(f"{tool_name}: {reply['error']}")
        return Call(seconds, 1, 0, reply)

    async def close(self) -> None:
        await self.caller.close()


class McpPeer:
    """The MCP peer through the same measurements, with the SDK's client."""

    def __init__(self, address: str) -> None:
        self.client = McpPeerClient(address[len("mcp:"):])

    async def execute(self, tool_name: str, arguments: dict[str, Any] | None = None,
                      expect_messages: int | None = None,
                      rpc_timeout: float = CALL_TIMEOUT) -> Call:
        started = time.perf_counter()
        try:
            result = await self.client.call(tool_name, arguments, seconds=rpc_timeout)
        except RuntimeError as exc:
            raise BenchError(str(exc)) from exc
        return Call(time.perf_counter() - started, 1, 0, result)

    async def stream_once(self, n: int, server_pid: int | None) -> dict[str, float]:
        """One ``bench_stream`` call: ``n`` progress notifications, each checked to arrive
        once and in order."""
        cpu_before = server_cpu_seconds(server_pid) if server_pid else 0.0
        expected = 1

        async def progress(value: float, total: float | None, message: str | None) -> None:
            nonlocal expected
            if int(value) != expected or message != f"{expected:07d}\n":
                raise BenchError(f"progress {expected} missing or out of order")
            expected += 1

        started = time.perf_counter()
        try:
            await self.client.call("bench_stream", {"n": n}, progress=progress)
        except RuntimeError as exc:
            raise BenchError(str(exc)) from exc
        seconds = time.perf_counter() - started
        cpu_used = server_cpu_seconds(server_pid) - cpu_before if server_pid else 0.0
        if expected - 1 != n:
            raise BenchError(f"stream: {expected - 1} of {n} progress notifications")
        return {"seconds": seconds, "messages": n, "events": n, "bytes": 0,
                "messages_per_s": n / seconds, "events_per_s": n / seconds,
                "tool_events_per_s": 0.0, "server_cpu_us_per_event": cpu_used / n * 1e6}

    async def close(self) -> None:
        await self.client.close()


Target = Client | SeedPeer | McpPeer


async def connect(target: str, token: str = "") -> Target:
    """The client for a ``--target`` (module docstring); only 127.0.0.1 is ever reached."""
    if target.startswith("seed:"):
        return SeedPeer(target)
    if target.startswith("mcp:"):
        peer = McpPeer(target)
        await peer.client.open()
        return peer
    channels = 1
    legacy = target.startswith("legacy:")
    if legacy:
        target = target[len("legacy:"):]
    if target.startswith("grpc*"):
        count, target = target[len("grpc*"):].split(":", 1)
        channels = min(max(1, int(count)), 64)
    if not target.startswith(("127.", "localhost:")):
        raise SystemExit("the benchmark only talks to 127.0.0.1")
    return (LegacyClient if legacy else Client)(target, token, channels)


def _turns(index: int, count: int) -> list[int]:
    """The order servers take their turn in round ``index``: rotating by one each round, so
    over ``count`` rounds each server takes each place once and none always goes first
    (right after another one's load). With two servers this alternates."""
    return [(index + k) % count for k in range(count)]


async def latency(clients: list[Target], calls: int, warmup: int, block: int = 1
                  ) -> list[dict[str, Any]]:
    """Sequential trivial calls (START, END, Result), the servers taking turns ``block``
    calls at a time: latency percentiles after warm-up.

    Turns of one call measure every server woken from idle with its caches cold (the others
    ran in between), which costs each call more the more servers take turns (bench/README.md,
    "The baseline, part by part"); a block measures a server warm, as a client calling it
    in sequence finds it, while the turns still spread the machine's noise over all.
    """
    for client in clients:
        for _ in range(warmup):
            await client.execute("bench_trivial", expect_messages=3)
    seconds: list[list[float]] = [[] for _ in clients]
    wire = [0 for _ in clients]
    block = max(1, block)
    for turn in range((calls + block - 1) // block):
        in_turn = min(block, calls - turn * block)
        for k in _turns(turn, len(clients)):
            for _ in range(in_turn):
                call = await clients[k].execute("bench_trivial", expect_messages=3)
                seconds[k].append(call.seconds)
                wire[k] = call.wire_bytes
    return [{"calls": calls, "block": block, "p50_ms": percentile(s, 0.5) * 1e3,
             "p99_ms": percentile(s, 0.99) * 1e3, "mean_ms": statistics.fmean(s) * 1e3,
             "bytes_per_call": w} for s, w in zip(seconds, wire, strict=True)]


async def _stream_once(client: Target, n: int, slow_every: int, slow_ms: float,
                       coalesce: int, server_pid: int | None, coalesce_deltas: bool
                       ) -> dict[str, float]:
    if isinstance(client, McpPeer):
        return await client.stream_once(n, server_pid)
    if not isinstance(client, Client):
        raise BenchError("this peer has no stream of deltas")
    cpu_before = server_cpu_seconds(server_pid) if server_pid else 0.0
    started = time.perf_counter()
    messages = events = wire = 0
    expected = 1
    result = None
    arguments: dict[str, Any] = {"n": n}
    if coalesce > 1:
        arguments["coalesce"] = coalesce  # understood by the bare baseline only
    async for response in client.start("bench_stream", arguments,
                                       coalesce_deltas=coalesce_deltas):
        messages += 1
        wire += response.ByteSize()
        event = response.event
        if event.HasField("result"):
            result = event.result
        elif event.step.phase == events_pb2.STEP_PHASE_DELTA:
            text = event.step.delta
            for k in range(0, len(text), DELTA_WIDTH):
                if text[k:k + DELTA_WIDTH] != f"{expected:07d}\n":
                    raise BenchError(f"delta {expected} missing or out of order")
                expected += 1
                events += 1
        if slow_every and messages % slow_every == 0:
            await asyncio.sleep(slow_ms / 1000)
    seconds = time.perf_counter() - started
    cpu_used = server_cpu_seconds(server_pid) - cpu_before if server_pid else 0.0
    if result is None or events != n:
        raise BenchError(f"stream: {events} of {n} deltas, result={result is not None}")
    tool_seconds = result.duration.ToNanoseconds() / 1e9
    return {
        "seconds": seconds, "messages": messages, "events": events, "bytes": wire,
        "messages_per_s": messages / seconds, "events_per_s": events / seconds,
        # How fast the tool could emit: its events over its own run time.
        "tool_events_per_s": n / tool_seconds if tool_seconds > 0 else 0.0,
        "server_cpu_us_per_event": cpu_used / n * 1e6,
    }


async def stream(clients: list[Target], n: int, runs: int, slow_every: int = 0,
                 slow_ms: float = 1.0, coalesce: int = 1,
                 server_pids: list[int] | None = None,
                 coalesce_deltas: bool = False) -> list[dict[str, Any]]:
    """Runs streaming ``n`` deltas each, the servers taking turns run by run; counts
    messages and the events inside them.

    With ``slow_every`` the client pauses ``slow_ms`` after every ``slow_every`` messages:
    a reader slower than the tool, so the server is under backpressure. Events are counted
    in the delta text (fixed width) and checked to arrive complete and in order, so a
    server that coalesces deltas is counted, and checked, event by event. ``coalesce`` asks
    the bare baseline for that many deltas per message; ``coalesce_deltas`` opts in to the
    server's own coalescing. With ``server_pids`` the servers' CPU per event is measured too.
    """
    pids = server_pids or [0 for _ in clients]
    figures: list[list[dict[str, float]]] = [[] for _ in clients]
    for run in range(runs):
        for k in _turns(run, len(clients)):
            figures[k].append(await _stream_once(clients[k], n, slow_every, slow_ms, coalesce,
                                                 pids[k] or None, coalesce_deltas))
    return [{"n": n, "runs": runs, "slow_every": slow_every, "slow_ms": slow_ms,
             "median_events_per_s": statistics.median(f["events_per_s"] for f in runs_),
             "median_messages_per_s": statistics.median(f["messages_per_s"] for f in runs_),
             "server_cpu_us_per_event": min(f["server_cpu_us_per_event"] for f in runs_),
             "best": max(runs_, key=lambda f: f["events_per_s"]), "all": runs_}
            for runs_ in figures]


async def concurrency(clients: list[Target], concurrent: int, rounds: int, ms: float = 10.0,
                      process_pids: list[list[int]] | None = None,
                      count_errors: bool = False) -> list[dict[str, Any]]:
    """Rounds of ``concurrent`` simultaneous calls of a tool that awaits ``ms``, the servers
    taking turns round by round. With ``process_pids`` (per server, its processes) the CPU
    each process used over the rounds is given too: how a server of several processes
    shared the load out. With ``count_errors`` a call that fails is counted, not raised,
    and calls/s counts the calls that succeeded."""

    async def one_round(client: Target) -> tuple[float, int]:
        started = time.perf_counter()
        done = await asyncio.gather(*(client.execute("bench_wait", {"ms": ms},
                                                     expect_messages=3)
                                      for _ in range(concurrent)),
                                    return_exceptions=count_errors)
        return time.perf_counter() - started, sum(isinstance(d, BaseException) for d in done)

    for client in clients:
        await one_round(client)  # warm-up: connections, code paths, allocator
    pids = process_pids or [[] for _ in clients]
    before = [[server_cpu_seconds(pid) for pid in group] for group in pids]
    walls: list[list[float]] = [[] for _ in clients]
    errors = [0 for _ in clients]
    client_cpu = [0.0 for _ in clients]  # this process's own CPU in each server's rounds
    for r in range(rounds):
        for k in _turns(r, len(clients)):
            cpu_before = time.process_time()
            wall, failed = await one_round(clients[k])
            client_cpu[k] += time.process_time() - cpu_before
            walls[k].append(wall)
            errors[k] += failed
    used = [[server_cpu_seconds(pid) - b for pid, b in zip(group, start, strict=True)]
            for group, start in zip(pids, before, strict=True)]
    return [{"concurrency": concurrent, "rounds": rounds, "tool_ms": ms,
             "median_wall_s": statistics.median(w),
             "calls_per_s": (concurrent - e / rounds) / statistics.median(w),
             "best_calls_per_s": concurrent / min(w), "errors": e,
             "walls_s": w, "process_cpu_s": u, "client_cpu_s": c}
            for w, u, e, c in zip(walls, used, errors, client_cpu, strict=True)]


async def held(clients: list[Client], streams: int, seconds: float, server_pids: list[int],
               open_timeout: float, probes: int = 5, probe_timeout: float = 5.0,
               batch_size: int = 250) -> list[dict[str, Any]]:
    """Holds ``streams`` runs open on a sleeping tool, one server after the other; measures
    each server's memory per open run and how fast a normal call is answered meanwhile."""
    return [await _held_one(client, streams, seconds, pid, open_timeout, probes,
                            probe_timeout, batch_size)
            for client, pid in zip(clients, server_pids, strict=True)]


async def _held_one(client: Client, streams: int, seconds: float, server_pid: int,
                    open_timeout: float, probes: int, probe_timeout: float,
                    batch_size: int) -> dict[str, Any]:
    for _ in range(20):  # warm-up, so the baseline RSS already holds the code paths
        await client.execute("bench_trivial", expect_messages=3)
    rss_before = server_rss_kb(server_pid)
    calls: list[Any] = []
    reads: list[asyncio.Future[Any]] = []
    open_started = time.perf_counter()
    deadline = open_started + open_timeout
    # Open the runs in batches, each once the previous batch's STARTs have arrived: a burst
    # of thousands of calls in one instant overflows gRPC core's queue of calls not yet
    # picked up by the application (1,000 soft, 3,000 hard by default), which cancels them.
    while len(calls) < streams and time.perf_counter() < deadline:
        batch = [client.start("bench_hold", {"seconds": seconds}, timeout=seconds + 60)
                 for _ in range(min(batch_size, streams - len(calls)))]
        batch_reads = [asyncio.ensure_future(call.read()) for call in batch]
        calls.extend(batch)
        reads.extend(batch_reads)
        await asyncio.wait(batch_reads, timeout=max(0.0, deadline - time.perf_counter()))
    open_seconds = time.perf_counter() - open_started
    opened = sum(1 for r in reads if r.done() and not r.cancelled() and r.exception() is None)
    pending = [r for r in reads if not r.done()]
    rss_held = server_rss_kb(server_pid)
    probe_seconds = []
    probe_errors = []
    for _ in range(probes):
        try:
            call = await client.execute("bench_trivial", expect_messages=3,
                                        rpc_timeout=probe_timeout)
            probe_seconds.append(call.seconds)
        except (grpc.aio.AioRpcError, BenchError) as exc:
            probe_errors.append(str(exc)[:200])
    # Runs that already ended would make the memory figure meaningless: count them.
    ended_early = sum(1 for call in calls if call.done())
    failed = [r.exception() for r in reads if r.done() and not r.cancelled() and r.exception()]
    for task in pending:
        task.cancel()
    for call in calls:
        call.cancel()
    await asyncio.gather(*reads, return_exceptions=True)
    # Ending thousands of runs keeps a server busy for a while (their Results, audit records
    # and run-log writes): let it finish before the next server is measured beside it.
    await _until_idle(server_pid)
    return {
        "streams": streams, "opened": opened, "open_seconds": open_seconds,
        "ended_early": ended_early, "open_errors": len(failed),
        "first_open_error": str(failed[0])[:200] if failed else None,
        "rss_before_kb": rss_before, "rss_held_kb": rss_held,
        "kb_per_open_run": (rss_held - rss_before) / opened if opened else None,
        "probe_ms": [s * 1e3 for s in probe_seconds],
        "probe_max_ms": max(probe_seconds) * 1e3 if probe_seconds else None,
        "probe_errors": probe_errors,
    }


async def _until_idle(pid: int, *, quiet_s: float = 0.25, limit_s: float = 20.0) -> None:
    """Returns once process ``pid`` used (almost) no CPU for ``quiet_s``, or after
    ``limit_s``."""
    deadline = time.perf_counter() + limit_s
    before = server_cpu_seconds(pid)
    while time.perf_counter() < deadline:
        await asyncio.sleep(quiet_s)
        now = server_cpu_seconds(pid)
        if now - before < 0.02 * quiet_s / 0.25:  # at most two clock ticks of 10 ms
            return
        before = now


async def cpu(clients: list[Target], calls: int, warmup: int, server_pids: list[int],
              block: int = 1) -> list[dict[str, Any]]:
    """Each server's CPU time per sequential trivial call (user + system, from /proc), the
    servers taking turns ``block`` calls at a time.

    Turns of one call measure every server with its caches cold (the others ran in
    between), which inflates the CPU of each call the more servers take turns; a block of
    calls per turn measures a server the way it runs in production, warm, while the turns
    still spread the machine's noise over all of them.
    """
    for client in clients:
        for _ in range(warmup):
            await client.execute("bench_trivial", expect_messages=3)
    before = [server_cpu_seconds(pid) for pid in server_pids]
    seconds: list[list[float]] = [[] for _ in clients]
    block = max(1, block)
    for turn in range((calls + block - 1) // block):
        in_turn = min(block, calls - turn * block)
        for k in _turns(turn, len(clients)):
            for _ in range(in_turn):
                seconds[k].append((await clients[k].execute(
                    "bench_trivial", expect_messages=3)).seconds)
    used = [server_cpu_seconds(pid) - b for pid, b in zip(server_pids, before, strict=True)]
    return [{"calls": calls, "block": block, "cpu_us_per_call": u / calls * 1e6,
             "server_cpu_s": u, "p50_ms": percentile(s, 0.5) * 1e3}
            for u, s in zip(used, seconds, strict=True)]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.client", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", action="append", required=True,
                        help="host:port on 127.0.0.1 (repeat to measure servers in turns)")
    parser.add_argument("--token", default=os.environ.get("BENCH_TOKEN", ""),
                        help="Bearer token [env BENCH_TOKEN]")
    parser.add_argument("--plan", required=True,
                        help='JSON list of {"measure": NAME, ARGUMENT: VALUE, …}')
    return parser


MEASURES: dict[str, Callable[..., Awaitable[list[dict[str, Any]]]]] = {
    "latency": latency, "stream": stream, "concurrency": concurrency, "held": held, "cpu": cpu,
}


async def run_plan(clients: list[Target], plan: list[dict[str, Any]]
                   ) -> dict[str, list[dict[str, Any]]]:
    """Runs each planned measurement in turn on its ``targets`` (default: every client); the
    figures by the plan's ``name`` (default: the measure), one entry per client measured, in
    the order of ``targets``."""
    figures = {}
    for entry in plan:
        arguments = dict(entry)
        measure = arguments.pop("measure")
        name = arguments.pop("name", measure)
        chosen = [clients[k] for k in arguments.pop("targets", range(len(clients)))]
        figures[name] = await MEASURES[measure](chosen, **arguments)
    return figures


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    clients: list[Target] = []
    try:
        for target in args.target:
            clients.append(await connect(target, args.token))
        # The servers' collector settings (stargrpc.server.tune_garbage_collector), here too:
        # the peers' SDKs this client imports would otherwise be walked by its collections.
        gc.collect()
        gc.freeze()
        gc.set_threshold(5_000, 20, 20)
        return await run_plan(clients, json.loads(args.plan))
    finally:
        for client in clients:
            await client.close()


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    try:
        figures = asyncio.run(_run(args))
    except (BenchError, grpc.aio.AioRpcError) as exc:
        print(json.dumps({"error": str(exc)[:500]}))
        sys.exit(1)
    if RETRIES:
        figures["retried_unavailable"] = [RETRIES]
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
