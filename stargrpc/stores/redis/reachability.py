"""Whether Redis answers this replica, as the server's health reports it.

Redis counts as *unreachable* from the moment a round trip of this replica gets no answer:
a PING of the probe, or a background write (a flush of events, a lease renewal) that failed
because Redis refused the connection, cut it, or did not answer within its bound — a
stalled Redis counts like a dead one. It counts as *reachable* again from the moment one
gets an answer. An error Redis answers with (a script refused, a slot moving, a full
connection pool) says nothing of whether it is reachable and changes nothing.

No call pays a round trip for this: the probe PINGs once every ``interval`` seconds in the
background (on a Redis Cluster, every primary: a run's keys may be on any), each PING
bounded by ``timeout`` (``redis_timeout_seconds``), so a replica that
runs nothing notices an outage within about ``interval + timeout``; a failing write of a
busy replica is noticed at once. Each change is logged once (``run_store_unreachable`` at
warning, ``run_store_reachable`` at info), set on the gauge ``stargrpc_run_store_reachable``
and handed to whoever awaits :meth:`Reachability.changed` (the server, which sets its
health status: :mod:`stargrpc.server.grpc_server`).
"""

from __future__ import annotations

import asyncio

import structlog
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import MaxConnectionsError, RedisError

from stargrpc import metrics
from stargrpc.stores.background import stop_background
from stargrpc.stores.redis.errors import as_redis_error

log = structlog.get_logger("stargrpc.stores.redis")


class Reachability:
    """Whether Redis answers, learnt from a periodic PING and from this replica's writes.

    Attributes:
        reachable: Whether the last round trip got an answer (True until one did not).
        interval: Seconds between two PINGs of the probe.
        timeout: Longest a PING may wait for its answer before Redis counts as unreachable.
    """

    reachable: bool
    interval: float
    timeout: float
    _redis: Redis | RedisCluster
    _changed: asyncio.Event
    _task: asyncio.Task[None] | None

    def __init__(self, redis: Redis | RedisCluster, *, interval: float, timeout: float) -> None:
        self._redis = redis
        self.interval = interval
        self.timeout = timeout
        self.reachable = True
        self._changed = asyncio.Event()
        self._task = None

    def answered(self) -> None:
        """Notes a round trip Redis answered: reachable (again)."""
        if not self.reachable:
            self.reachable = True
            metrics.RUN_STORE_REACHABLE.labels("redis").set(1)
            log.info("run_store_reachable", store="redis",
                     detail="Redis answers again: health SERVING")
            self._signal()

    def unanswered(self, error: str) -> None:
        """Notes a round trip Redis did not answer (``error`` says how): unreachable."""
        if self.reachable:
            self.reachable = False
            metrics.RUN_STORE_REACHABLE.labels("redis").set(0)
            log.warning("run_store_unreachable", store="redis", error=error,
                        detail="health NOT_SERVING until Redis answers again")
            self._signal()

    async def changed(self, seen: bool) -> bool:
        """Waits until :attr:`reachable` is other than ``seen``; returns it."""
        while self.reachable == seen:
            await self._changed.wait()
        return self.reachable

    def _signal(self) -> None:
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    async def probe(self) -> bool:
        """PINGs Redis once (bounded by :attr:`timeout`) and notes the outcome; whether it
        answered. A full connection pool is load, not an outage: it changes nothing."""
        try:
            # The deadline outside as_redis_error(): running out of it is no answer either way.
            async with asyncio.timeout(self.timeout):
                with as_redis_error():
                    if isinstance(self._redis, RedisCluster):  # each primary, not just one
                        await self._redis.ping(target_nodes=RedisCluster.PRIMARIES)
                    else:
                        await self._redis.ping()
        except MaxConnectionsError:
            return self.reachable
        except (RedisError, TimeoutError) as exc:
            self.unanswered(str(exc) or "no answer in time")
            return False
        self.answered()
        return True

    async def start(self) -> None:
        """Probes once (so the server's first health status is Redis's), then goes on
        probing in the background."""
        if self._task is not None:
            return
        await self.probe()
        metrics.RUN_STORE_REACHABLE.labels("redis").set(1 if self.reachable else 0)
        self._task = asyncio.create_task(self._loop(), name="redis-reachability-probe")

    async def stop(self) -> None:
        """Stops probing."""
        task, self._task = self._task, None
        await stop_background(task, "reachability-probe")

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.probe()
            except Exception:  # one bad probe must not end the probing
                log.exception("redis_probe_error")
