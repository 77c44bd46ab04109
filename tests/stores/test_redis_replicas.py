"""Two ``stargrpc serve`` processes sharing Redis: watching and replaying across them,
client-side round_robin over both, and a replica killed with SIGKILL mid-run."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import grpc
from redis.asyncio import Redis

from stargrpc.v1 import events_pb2, tool_service_pb2, tool_service_pb2_grpc
from tests.procs import ServerProcess, server_env
from tests.runs_support import RUN_TOOLS_DIR, collect, execute_request, key, stripped
from tests.stores.conftest import REDIS_URL


@contextmanager
def two_replicas(tmp_path: Path, prefix: str, lease: str = "10"
                 ) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """Replicas A and B sharing Redis under ``prefix``, started side by side (start-up is
    mostly imports, so this halves the wait)."""
    def start(name: str) -> ServerProcess:
        return ServerProcess(
            ["--tools-dir", str(RUN_TOOLS_DIR), "--redis-url", REDIS_URL],
            server_env(tmp_path / name, STARGRPC_REDIS_KEY_PREFIX=prefix,
                       STARGRPC_RUN_LEASE_SECONDS=lease))

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(start, name) for name in ("a", "b")]
    started = [f.result() for f in futures if f.exception() is None]
    try:
        if len(started) < 2:
            raise next(f.exception() for f in futures if f.exception() is not None)
        yield started[0], started[1]
    finally:
        for server in started:
            server.stop()


async def test_two_processes_share_runs_balance_calls_and_survive_a_sigkill(
        tmp_path: Path, redis_prefix: str) -> None:
    # Both server processes are started once for the three scenarios: start-up dominates.
    with two_replicas(tmp_path, redis_prefix, lease="2") as (a, b):
        async with grpc.aio.insecure_channel(a.target) as chan_a, \
                grpc.aio.insecure_channel(b.target) as chan_b:
            stub_a = tool_service_pb2_grpc.ToolServiceStub(chan_a)
            stub_b = tool_service_pb2_grpc.ToolServiceStub(chan_b)
            await _watch_and_replay_across(stub_a, stub_b, tmp_path / "one")
            await _round_robin_over_both(a, b, redis_prefix)
            await _sigkill_loses_the_run_and_a_retry_runs_once(a, stub_a, stub_b,
                                                               tmp_path / "two")


async def _watch_and_replay_across(stub_a, stub_b, folder: Path) -> None:
    """A run on A is watched live from B and replayed by an idempotent retry on B."""
    tally, gate = folder.with_name(folder.name + "-tally"), folder.with_name(folder.name + "-gate")
    request = execute_request("tally", {"path": str(tally), "gate": str(gate)},
                              idempotency_key=key())
    call = stub_a.Execute(request)
    first = (await call.read()).event
    live = stub_b.WatchRun(tool_service_pb2.WatchRunRequest(run_id=first.run_id))
    live_first = (await live.read()).event
    gate.touch()
    executed = [first, *await collect(call)]
    watched = [live_first, *await collect(live)]
    after = await collect(stub_b.WatchRun(tool_service_pb2.WatchRunRequest(
        run_id=first.run_id)))
    replayed = await collect(stub_b.Execute(request))

    assert stripped(watched) == stripped(executed)
    assert stripped(after) == stripped(executed)
    assert stripped(replayed) == stripped(executed)
    assert len(tally.read_text().split()) == 1


async def _round_robin_over_both(a: ServerProcess, b: ServerProcess, prefix: str) -> None:
    """200 calls through gRPC's own round_robin over both replicas: no errors, both used."""
    balanced = grpc.aio.insecure_channel(
        f"ipv4:{a.target},{b.target}", options=[("grpc.lb_policy_name", "round_robin")])
    async with balanced:
        stub = tool_service_pb2_grpc.ToolServiceStub(balanced)
        outcomes = []
        run_ids = []
        for batch in range(10):  # 200 calls, 20 at a time
            streams = await asyncio.gather(*(
                collect(stub.Execute(execute_request(
                    "echo", {"text": f"{batch}-{i}"},
                    idempotency_key=key() if i % 2 else "")))
                for i in range(20)))
            outcomes += [s[-1].result.outcome for s in streams]
            run_ids += [s[0].run_id for s in streams]
    redis = Redis.from_url(REDIS_URL)
    try:
        replicas_used = {await redis.hget(f"{prefix}run:{run_id}", "replica")
                         for run_id in run_ids}
    finally:
        await redis.aclose()

    assert outcomes == [events_pb2.OUTCOME_OK] * 200
    assert len(replicas_used - {None}) == 2


async def _sigkill_loses_the_run_and_a_retry_runs_once(a: ServerProcess, stub_a, stub_b,
                                                       folder: Path) -> None:
    """A is killed mid-run: B's watcher is told the run was lost, and a retry with the same
    key on B runs the tool (once) after A's lease has expired."""
    tally, gate = folder.with_name(folder.name + "-tally"), folder.with_name(folder.name + "-gate")
    request = execute_request("tally", {"path": str(tally), "gate": str(gate)},
                              idempotency_key=key())
    call = stub_a.Execute(request)
    head = [(await call.read()).event for _ in range(3)]
    watcher = stub_b.WatchRun(tool_service_pb2.WatchRunRequest(run_id=head[0].run_id,
                                                               after_seq=2))
    await watcher.read()  # following live on B
    a.signal(signal.SIGKILL)
    a.proc.wait(10)
    told = await asyncio.wait_for(collect(watcher), 30)
    gate.touch()
    retried = await collect(stub_b.Execute(request))
    again = await collect(stub_b.Execute(request))

    assert told[-1].result.outcome == events_pb2.OUTCOME_ERROR
    assert told[-1].result.error.code == "RUN_LOST"
    assert retried[-1].result.outcome == events_pb2.OUTCOME_OK
    assert stripped(again) == stripped(retried)
    assert tally.read_text().split() == [head[0].run_id, retried[0].run_id]
