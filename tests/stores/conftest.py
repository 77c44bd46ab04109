"""Fixtures of the Redis store tests: the real Redis on 127.0.0.1:6379, a key prefix of
their own per test (deleted afterwards), servers sharing it, and a redis-server of a test's
own that it can stall."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from redis import Redis as SyncRedis
from redis.asyncio import Redis

from bench.ports import free_ports
from tests.helpers import eventually
from tests.stores.helpers import redis_cli

REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture
async def redis_prefix() -> AsyncIterator[str]:
    """A fresh key prefix; every key under it is deleted after the test."""
    prefix = f"stargrpc-test:{uuid.uuid4().hex[:12]}:"
    yield prefix
    # A generous timeout: the test's own loop may have been busy (a server it ran going
    # down) for longer than redis-py's default of 5 s, which then fails the cleanup.
    client = Redis.from_url(REDIS_URL, socket_timeout=30, socket_connect_timeout=30)
    try:
        keys = [k async for k in client.scan_iter(match=f"{prefix}*", count=1000)]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


@pytest.fixture
async def replicas(make_server, redis_prefix: str):
    """A factory of in-process replicas sharing Redis under this test's prefix."""
    from tests.runs_support import HeaderPrincipal, run_registry

    async def start(**overrides):
        return await make_server(registry=run_registry(), interceptors=[HeaderPrincipal()],
                                 redis_url=REDIS_URL, redis_key_prefix=redis_prefix,
                                 **overrides)

    return start


class StallableRedis:
    """A redis-server of the test's own on a free loopback port, which the test can stall
    (SIGSTOP), resume (SIGCONT) and kill: the shared Redis on 6379 is never touched."""

    port: int
    url: str
    proc: subprocess.Popen[bytes] | None

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.proc = None
        [self.port] = free_ports(1)  # restarted on it after a kill: not an ephemeral one
        self.url = f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        """Starts the server (again, empty, after a kill) and waits until it answers."""
        # Popen returns once the process is forked: nothing to wait for on the loop.
        self.proc = subprocess.Popen(  # noqa: ASYNC220
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.folder)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        await eventually(_off_loop(lambda: _answers(self.proc, self.port)), within=20,
                         interval=0.05, what="redis-server answering PING")

    def stall(self) -> None:
        """Freezes the server: connections stay open, nothing is answered."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """Lets a stalled server go on (it then serves what queued up meanwhile)."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        """Kills the server (stalled or not); its data is gone."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture
async def stallable_redis(tmp_path: Path) -> AsyncIterator[StallableRedis]:
    """A started :class:`StallableRedis`, killed by its PID afterwards."""
    redis = StallableRedis(tmp_path)
    await redis.start()
    try:
        yield redis
    finally:
        redis.kill()


def _node(port: int) -> SyncRedis:
    """A plain (non-cluster) client of one node, for the cluster's own administration."""
    return SyncRedis(host="127.0.0.1", port=port, socket_timeout=30)


def _each(node: SyncRedis, commands: list[tuple[Any, ...]]) -> list[Any]:
    """Each command's reply, sent in one pipeline; the first error raised."""
    pipe = node.pipeline(transaction=False)
    for command in commands:
        pipe.execute_command(*command)
    return list(pipe.execute())


def _answers(proc: subprocess.Popen[bytes] | None, port: int) -> bool:
    """Whether the redis-server ``proc`` on ``port`` answers PING; fails at once, saying so,
    when it has exited (its port taken, say) rather than waiting out the test's bound."""
    if proc is not None and proc.poll() is not None:
        raise AssertionError(f"redis-server for port {port} exited ({proc.returncode}) "
                             "before answering: was its port taken?")
    return redis_cli(port, "ping") == "PONG"


def _off_loop(check: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    """``check`` (which runs redis-cli: processes give no event to await) for
    :func:`~tests.helpers.eventually`, in a thread, so the test's event loop goes on."""
    return lambda: asyncio.to_thread(check)


class RedisProcesses:
    """redis-server processes of a test's own on loopback, in its tmp dir, each stopped by its
    PID: a cluster or a Sentinel set-up. The shared Redis on 6379 is never touched."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    async def start(self, port: int, *args: str, sentinel: bool = False) -> None:
        """Starts a server (or a Sentinel) on ``port`` and waits until it answers PING."""
        home = self.folder / str(port)
        home.mkdir(exist_ok=True)
        if sentinel:
            conf = home / "sentinel.conf"
            conf.write_text("\n".join(args) + "\n")
            command = ["redis-server", str(conf), "--sentinel", "--port", str(port),
                       "--bind", "127.0.0.1", "--dir", str(home)]
        else:
            command = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                       "--appendonly", "no", "--dir", str(home), *args]
        # Popen returns once the process is forked: nothing to wait for on the loop.
        self.procs[port] = subprocess.Popen(command, stdout=subprocess.DEVNULL,  # noqa: ASYNC220
                                            stderr=subprocess.DEVNULL)
        await eventually(_off_loop(lambda: _answers(self.procs[port], port)), within=20,
                         interval=0.05, what=f"redis on {port} answering")

    def kill(self, port: int) -> None:
        """Kills one server by its PID (SIGKILL: no goodbye to its replicas)."""
        proc = self.procs.get(port)
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def stop_all(self) -> None:
        """Kills every server started here."""
        for port in list(self.procs):
            self.kill(port)


class LoopbackCluster(RedisProcesses):
    """A Redis Cluster of 3 primaries and 3 replicas (``redis-cli --cluster create``)."""

    ports: list[int]
    url: str

    async def create(self) -> None:
        """Starts the six nodes and joins them into a cluster whose every slot is served."""
        self.ports = free_ports(6, bus=True)
        for port in self.ports:
            await self.start(port, "--cluster-enabled", "yes", "--cluster-node-timeout", "1000",
                       "--cluster-config-file", f"nodes-{port}.conf")
        out = await asyncio.to_thread(
            subprocess.run, ["redis-cli", "--cluster", "create",
                             *(f"127.0.0.1:{port}" for port in self.ports),
                             "--cluster-replicas", "1", "--cluster-yes"],
            capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        await eventually(_off_loop(lambda: all(
            "cluster_state:ok" in redis_cli(port, "cluster", "info") for port in self.ports)),
            within=30, interval=0.05, what="the cluster state ok")
        await eventually(_off_loop(lambda: all(
            "master_link_status:up" in redis_cli(port, "info", "replication")
            for port in self.replica_ports())),
            within=30, interval=0.05, what="every replica in sync")
        self.url = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def roles(self) -> dict[int, str]:
        """Each live node's role, master or slave, as the node says of itself (INFO
        replication). Another node's CLUSTER NODES may lag just after a change: sending
        CLUSTER SETSLOT to a node that view still calls a master fails with "use SETSLOT only
        with masters"."""
        roles = {}
        for port in self.ports:
            if self.procs[port].poll() is not None:
                continue
            lines = redis_cli(port, "info", "replication").splitlines()
            if "role:master" in lines:
                roles[port] = "master"
            elif "role:slave" in lines:
                roles[port] = "slave"
        return roles

    def primary_ports(self) -> list[int]:
        """The ports of the live primaries."""
        return [port for port, role in self.roles().items() if role == "master"]

    def replica_ports(self) -> list[int]:
        """The ports of the live replicas."""
        return [port for port, role in self.roles().items() if role == "slave"]

    def slots_of(self, port: int) -> list[int]:
        """The slots primary ``port`` serves (CLUSTER SLOTS, asked of that node)."""
        slots: list[int] = []
        for first, last, primary, *_ in _node(port).execute_command("CLUSTER", "SLOTS"):
            if int(primary[1]) == port:
                slots.extend(range(int(first), int(last) + 1))
        return slots

    def move_slots(self, source: int, target: int, slots: list[int], *, hold: float = 0.0,
                   first: Callable[[bytes], bool] | None = None) -> int:
        """Moves ``slots`` from primary ``source`` to primary ``target`` the way
        ``redis-cli --cluster reshard`` does — IMPORTING on the target, MIGRATING on the
        source, MIGRATE of their keys, then the slot given to the target on every primary —
        but holding each stage open for ``hold`` seconds, so that commands meet it: first
        with the slots open and no key moved yet, then (with ``first``) with the keys
        ``first`` picks moved and the others not. The number of keys moved."""
        src, dst = _node(source), _node(target)
        src_id, dst_id = src.cluster("myid"), dst.cluster("myid")
        _each(dst, [("CLUSTER", "SETSLOT", s, "IMPORTING", src_id) for s in slots])
        _each(src, [("CLUSTER", "SETSLOT", s, "MIGRATING", dst_id) for s in slots])
        time.sleep(hold)  # a window of time by design: commands arrive in the open slots
        moved = 0
        if first is not None:
            moved += self._migrate(src, target, slots, first)
            time.sleep(hold)  # a run's keys now split across two nodes
        for _ in range(50):  # keys made meanwhile (on the source, by commands it still took)
            count = self._migrate(src, target, slots, lambda _key: True)
            moved += count
            if count == 0:
                break
        primaries = [target, source, *(p for p in self.primary_ports() if p not in
                                        (source, target))]
        for port in primaries:
            _each(_node(port), [("CLUSTER", "SETSLOT", s, "NODE", dst_id) for s in slots])
        return moved

    @staticmethod
    def _migrate(src: SyncRedis, target: int, slots: list[int],
                 which: Callable[[bytes], bool]) -> int:
        keys = _each(src, [("CLUSTER", "GETKEYSINSLOT", s, 1000) for s in slots])
        moved = 0
        for found in keys:  # slot by slot, as redis-cli does (MIGRATE takes one slot's keys)
            picked = [key for key in found if which(key)]
            if picked:
                src.execute_command("MIGRATE", "127.0.0.1", target, "", 0, 10_000, "KEYS",
                                    *picked)
                moved += len(picked)
        return moved

    async def await_failover(self, killed: int) -> None:
        """Waits until the cluster serves every slot again after primary ``killed`` died."""
        live = [port for port in self.ports if port != killed]
        await eventually(_off_loop(lambda: len(self.primary_ports()) == 3 and all(
            "cluster_state:ok" in redis_cli(port, "cluster", "info") for port in live)),
            within=30, interval=0.05, what="a replica promoted")


@pytest.fixture
async def redis_cluster(tmp_path: Path) -> AsyncIterator[LoopbackCluster]:
    """A started :class:`LoopbackCluster`, every node killed by its PID afterwards."""
    cluster = LoopbackCluster(tmp_path)
    try:
        await cluster.create()
        yield cluster
    finally:
        cluster.stop_all()


class LoopbackSentinel(RedisProcesses):
    """One primary, one replica and three Sentinels watching them as ``stargrpc``."""

    primary: int
    replica: int
    sentinels: list[int]
    url: str

    async def create(self) -> None:
        """Starts the primary, its replica (in sync) and the Sentinels (which know both)."""
        self.primary, self.replica, *self.sentinels = free_ports(5)
        await self.start(self.primary)
        await self.start(self.replica, "--replicaof", "127.0.0.1", str(self.primary))
        await eventually(_off_loop(lambda: "master_link_status:up" in redis_cli(
            self.replica, "info", "replication")),
            within=30, interval=0.05, what="the replica in sync")
        for port in self.sentinels:
            await self.start(port, f"sentinel monitor stargrpc 127.0.0.1 {self.primary} 2",
                       "sentinel down-after-milliseconds stargrpc 1000",
                       "sentinel failover-timeout stargrpc 5000", sentinel=True)
        await eventually(_off_loop(lambda: all(
            "slaves=1,sentinels=3" in redis_cli(port, "info", "sentinel")
            for port in self.sentinels)),
            within=30, interval=0.05, what="the Sentinels seeing the replica and each other")
        self.url = "redis+sentinel://" + ",".join(
            f"127.0.0.1:{port}" for port in self.sentinels) + "/stargrpc"

    def current_primary(self) -> int:
        """The port of the primary the Sentinels name now."""
        reply = redis_cli(self.sentinels[0], "sentinel", "get-master-addr-by-name", "stargrpc")
        return int(reply.split()[1])


@pytest.fixture
async def redis_sentinel(tmp_path: Path) -> AsyncIterator[LoopbackSentinel]:
    """A started :class:`LoopbackSentinel`, every process killed by its PID afterwards."""
    sentinel = LoopbackSentinel(tmp_path)
    try:
        await sentinel.create()
        yield sentinel
    finally:
        sentinel.stop_all()
