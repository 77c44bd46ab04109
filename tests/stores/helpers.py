"""What the Redis store tests share: redis-cli on a port of a test's own, a throw-away
redis-server (:class:`OwnRedis`) on a free port, and, for the Cluster and Sentinel tests, two
replicas sharing runs, a keyed call retried until it has a Result, and the check that a run's
events are whole."""

from __future__ import annotations

import asyncio
import itertools
import subprocess
from pathlib import Path
from typing import Any

import grpc
from redis.asyncio.cluster import RedisCluster

from stargrpc.v1 import events_pb2
from tests.helpers import eventually
from tests.runs_support import HeaderPrincipal, collect, execute_request, key, run_registry


def redis_cli(port: int, *args: str, timeout: float = 10) -> str:
    """``redis-cli -p port args...``'s output, stripped (a node of a test's own)."""
    return subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True,
                          text=True, timeout=timeout).stdout.strip()


class OwnRedis:
    """A throw-away redis-server on ``port`` that the test starts and stops."""

    def __init__(self, port: int, folder: Path) -> None:
        self.port = port
        self.folder = folder

    async def start(self) -> None:
        await asyncio.to_thread(
            subprocess.run, ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no", "--daemonize", "yes",
                             "--dir", str(self.folder),
                             "--pidfile", str(self.folder / "redis.pid")], check=True)
        await eventually(lambda: asyncio.to_thread(
            lambda: self._cli("ping").stdout.strip() == "PONG"), within=20, interval=0.05,
            what="redis-server answering PING")

    def stop(self) -> None:
        self._cli("shutdown", "nosave")

    def _cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["redis-cli", "-p", str(self.port), *args],
                              capture_output=True, text=True, timeout=10)


def assert_whole(events: list[events_pb2.RunEvent]) -> None:
    """Seqs 1..N with no gap and no repeat, the Result last and only there."""
    assert [event.seq for event in events] == list(range(1, len(events) + 1))
    assert [event.HasField("result") for event in events] == [False] * (len(events) - 1) + [True]


async def stored_events(client: RedisCluster, prefix: str, run_id: str
                        ) -> list[events_pb2.RunEvent]:
    """The events of run ``run_id`` as stored under ``prefix`` in a Redis Cluster."""
    entries: Any = await client.xrange(f"{prefix}run:{{{run_id}}}:events")
    return [events_pb2.RunEvent.FromString(fields[b"e"]) for _, fields in entries]


async def two_replicas(make_server, url: str, **overrides: Any) -> list[Any]:
    """Two servers sharing runs in the Redis at ``url`` (prefix ``stargrpc:``)."""
    return [await make_server(registry=run_registry(), interceptors=[HeaderPrincipal()],
                              redis_url=url, redis_key_prefix="stargrpc:", **overrides)
            for _ in range(2)]


async def keyed_call(stubs: list[Any], index: int, folder: Path, gate: Path
                     ) -> tuple[str, list[list[events_pb2.RunEvent]]]:
    """One keyed call, retried with its key (on the other replica too) until it has a Result
    that is not RUN_LOST; its key's tally path and every stream it got."""
    tally = folder / f"tally-{index}"
    request = execute_request("tally", {"path": str(tally), "gate": str(gate), "deltas": 5},
                              idempotency_key=key())
    streams: list[list[events_pb2.RunEvent]] = []
    attempts = itertools.count()

    async def a_result() -> bool:
        stub = stubs[(index + next(attempts)) % 2]
        try:
            events = await asyncio.wait_for(collect(stub.Execute(request)), 60)
        except grpc.aio.AioRpcError as exc:  # refused before it ran: the store was failing over
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
            return False
        streams.append(events)
        return events[-1].result.error.code != "RUN_LOST"

    await eventually(a_result, within=90, interval=0.2,
                     what=f"call {index} getting a Result other than RUN_LOST")
    return str(tally), streams
