"""The Redis run store as the runtime sees it: :class:`RedisRunStore`, a thin facade over
the rooms of :mod:`stargrpc.stores.redis` (see there for what Redis holds and why)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from typing import Any

import structlog
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from stargrpc.errors import ResourceExhausted, reason_name
from stargrpc.ids import minted_ms
from stargrpc.principal import current_principal
from stargrpc.settings import LaneConfig, Settings
from stargrpc.stores.background import stop_background
from stargrpc.stores.base import (
    CancelHandler,
    Claim,
    RunLog,
    RunPage,
    RunQuery,
    SteerHandler,
    run_finished_error,
)
from stargrpc.stores.connect import connect
from stargrpc.stores.keys import KeyLayout, could_be_run_id
from stargrpc.stores.redis.approvals import RedisApprovalStore
from stargrpc.stores.redis.claims import SLOT_MOVING_RETRY_SECONDS, Claims
from stargrpc.stores.redis.errors import RETRY_AFTER_SECONDS, SLOT_MOVING, reachable, request_error
from stargrpc.stores.redis.flusher import Flusher
from stargrpc.stores.redis.index import RunIndex, tree_of
from stargrpc.stores.redis.lanes import RedisLanes
from stargrpc.stores.redis.leases import Leases, Sweep
from stargrpc.stores.redis.logs import LocalRuns, RedisRunLog, RemoteRunLog
from stargrpc.stores.redis.reachability import Reachability
from stargrpc.stores.redis.shared import Shared
from stargrpc.stores.redis.state import RedisStateStore
from stargrpc.v1 import errors_pb2

log = structlog.get_logger("stargrpc.stores.redis")

#: Most lookups of runs unknown to Redis but minted a moment ago (by their id) that wait for
#: the run's first write at once, per store; further ones are not found at once.
MAX_FRESH_RUN_WAITS = 64
#: Of those, most one principal's lookups hold at once: one caller naming fresh-looking ids
#: of runs that do not exist must not take every wait, and so answer others' lookups of
#: runs just admitted on another replica NOT_FOUND.
MAX_FRESH_RUN_WAITS_PER_PRINCIPAL = 8


class RedisRunStore:
    """Run logs, owners, idempotency claims and leases in Redis, shared by replicas.

    Attributes:
        shared: The client, settings and state its rooms share (``redis``, ``keys``,
            ``replica``, ``timeout`` … are read from it).
        leases: Leases and lost runs.
        sweep: The background sweep for lost runs.
        index: The ListRuns index.
        flusher: Writes this replica's events to Redis.
        claims: Registration before a run starts, and idempotency claims.
        state: Run state (``ctx.state``), on the same client.
        approvals: Approval requests and decisions (:mod:`.approvals`), on the same client.
        lanes: The fleet's lanes, once the runtime asked for them (:meth:`lanes_for`).
    """

    shared: Shared
    leases: Leases
    sweep: Sweep
    index: RunIndex
    flusher: Flusher
    claims: Claims
    state: RedisStateStore
    approvals: RedisApprovalStore
    lanes: RedisLanes | None
    _fresh_waits: int
    _fresh_waits_by: dict[str, int]
    _renewer: asyncio.Task[None] | None

    def __init__(self, redis: Redis | RedisCluster, *, prefix: str = "stargrpc:",
                 retention: float = 600.0, lease: float = 10.0, max_events: int = 100_000,
                 block_seconds: float = 1.0, flush_timeout: float = 5.0,
                 timeout: float = 2.0, wait_replicas: int = 0,
                 wait_timeout_ms: int = 500, max_pending_steers: int = 16,
                 sweep_interval: float = 1.0, probe_interval: float = 1.0) -> None:
        """
        Args:
            redis: The client (one Redis, or a cluster: then claims take two steps).
            prefix: Prefix of every key.
            retention: Seconds a finished run stays in Redis.
            lease: Seconds of a run's lease (renewed about every second).
            max_events: Events a run's stream keeps at most.
            block_seconds: Longest a blocking read waits in one call.
            flush_timeout: Longest a flusher round trip may take before it counts as failed.
            timeout: Longest a call waits for Redis before the run starts (publish and claim
                together); past it the call fails UNAVAILABLE.
            wait_replicas: Replicas that must acknowledge each claim and batch of events
                (WAIT).
            wait_timeout_ms: How long a write waits for them.
            max_pending_steers: Steering messages left for another replica's run at most.
            sweep_interval: Seconds between two sweeps for lost runs (on average three
                quarters of it: jittered), at most a quarter of the lease.
            probe_interval: Seconds between two PINGs that tell whether Redis answers (the
                server's health: :mod:`.reachability`), each bounded by ``timeout``.
        """
        self.shared = Shared(redis, prefix=prefix, retention=retention, lease=lease,
                             max_events=max_events, block_seconds=block_seconds,
                             flush_timeout=flush_timeout, timeout=timeout,
                             wait_replicas=wait_replicas, wait_timeout_ms=wait_timeout_ms,
                             max_pending_steers=max_pending_steers,
                             probe_interval=probe_interval)
        self.leases = Leases(self.shared)
        self.sweep = Sweep(self.shared, self.leases, sweep_interval)
        self.index = RunIndex(self.shared, self.sweep)
        self.flusher = Flusher(self.shared, self.leases, self.index)
        self.claims = Claims(self.shared, self.leases, self.index)
        self.state = RedisStateStore(redis, prefix=prefix)
        self.approvals = RedisApprovalStore(redis, prefix=prefix)
        self.lanes = None
        self._fresh_waits = 0
        self._fresh_waits_by = {}
        self._renewer = None

    @classmethod
    def from_settings(cls, settings: Settings) -> RedisRunStore:
        """A store for ``settings.redis_url`` (one Redis, a cluster, or the primary Sentinel
        names: :mod:`stargrpc.stores.connect`) with fail-fast timeouts."""
        timeout = settings.redis_timeout_seconds
        client, _ = connect(settings.redis_url, timeout=timeout)
        # A write that waits for replicas may take that much longer before it counts.
        wait = settings.redis_wait_timeout_ms / 1000 if settings.redis_wait_replicas else 0.0
        return cls(client, prefix=settings.redis_key_prefix,
                   retention=settings.run_retention_seconds, lease=settings.run_lease_seconds,
                   max_events=settings.run_max_events, block_seconds=min(1.0, timeout / 2),
                   flush_timeout=timeout + 1.0 + wait, timeout=timeout + wait,
                   wait_replicas=settings.redis_wait_replicas,
                   wait_timeout_ms=settings.redis_wait_timeout_ms,
                   max_pending_steers=settings.steer_max_pending,
                   sweep_interval=settings.run_sweep_interval_seconds,
                   probe_interval=settings.redis_ping_interval_seconds)

    # -- what the store shares, as the runtime and operators read it --------------------------

    @property
    def redis(self) -> Redis | RedisCluster:
        """The client."""
        return self.shared.redis

    @property
    def keys(self) -> KeyLayout:
        """The key layout (hash-tagged on a cluster)."""
        return self.shared.keys

    @property
    def cluster(self) -> bool:
        """Whether ``redis`` is a Redis Cluster client."""
        return self.shared.cluster

    @property
    def replica(self) -> str:
        """This replica's id, recorded with the runs it executes."""
        return self.shared.replica

    @property
    def prefix(self) -> str:
        """Prefix of every key."""
        return self.shared.prefix

    @property
    def timeout(self) -> float:
        """Longest a call waits for Redis before the run starts (publish and claim
        together); past it the call fails UNAVAILABLE."""
        return self.shared.timeout

    @property
    def flush_timeout(self) -> float:
        """Longest a flusher round trip may take before it counts as failed."""
        return self.shared.flush_timeout

    @property
    def lease_ms(self) -> int:
        """A run's lease, in ms."""
        return self.shared.lease_ms

    @property
    def max_pending_steers(self) -> int:
        """Steering messages left for another replica's run at most."""
        return self.shared.max_pending_steers

    @property
    def sweep_interval(self) -> float:
        """Seconds between two sweeps for lost runs (see :class:`Sweep`)."""
        return self.sweep.interval

    @property
    def runs(self) -> LocalRuns:
        """The runs executing on this replica."""
        return self.shared.runs

    @property
    def healthy(self) -> bool:
        """Whether Redis answered the last write (see :attr:`Shared.healthy`)."""
        return self.shared.healthy

    @healthy.setter
    def healthy(self, value: bool) -> None:
        self.shared.healthy = value

    @property
    def reachability(self) -> Reachability:
        """Whether Redis answers this replica (its health status follows it)."""
        return self.shared.reachability

    @property
    def cancel_handler(self) -> CancelHandler | None:
        """Set by the runtime; stops a run of this process."""
        return self.shared.cancel_handler

    @cancel_handler.setter
    def cancel_handler(self, handler: CancelHandler | None) -> None:
        self.shared.cancel_handler = handler

    @property
    def steer_handler(self) -> SteerHandler | None:
        """Set by the runtime; steers a run of this process."""
        return self.shared.steer_handler

    @steer_handler.setter
    def steer_handler(self, handler: SteerHandler | None) -> None:
        self.shared.steer_handler = handler

    def lanes_for(self, configs: Mapping[str, LaneConfig]) -> RedisLanes:
        """The lanes ``configs`` name, shared with every replica through this store. Made
        once: a second runtime on the same store shares them (a second set would run a loop
        :meth:`aclose` never stops)."""
        if self.lanes is None:
            self.lanes = RedisLanes(self.shared, configs)
        return self.lanes

    # -- RunStore --------------------------------------------------------------------------

    def create(self, run_id: str, owner: str = "", tool: str = "") -> RedisRunLog:
        return RedisRunLog(run_id, owner, tool, self.flusher.wants_flush)

    async def open(self, run_id: str) -> RunLog | None:
        local = self.shared.runs.get(run_id)
        if local is not None:
            return local
        if not could_be_run_id(run_id):
            # "<id>:events" would read another run's stream as its meta hash: a WRONGTYPE
            # told as UNAVAILABLE, and only for a run that exists.
            return None
        with reachable("looking up the run"):
            meta, last = await self._look_up(run_id)
            if not meta and await self._first_write_of(run_id):
                meta, last = await self._look_up(run_id)
        if not meta:
            return None
        last_seq = int(last[0][0].split(b"-", 1)[0]) if last else 0
        remote = RemoteRunLog(self.leases, run_id, meta.get(b"owner", b"").decode(),
                              meta.get(b"tool", b"").decode(),
                              finished=meta.get(b"state") != b"running", last_seq=last_seq)
        tree = tree_of(meta)
        if tree is not None:
            remote.parent_run_id, remote.root_run_id, remote.depth = tree
        return remote

    async def _look_up(self, run_id: str) -> tuple[dict[bytes, bytes], list[Any]]:
        """A run's meta hash (empty when Redis has none) and its last event."""
        shared = self.shared
        async with shared.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(shared.key(run_id))
            pipe.xrevrange(shared.key(run_id, "events"), count=1)
            meta, last = await pipe.execute()
        return meta, last

    async def _first_write_of(self, run_id: str) -> bool:
        """Waits for the first events of a run that Redis does not know yet but that was
        admitted a moment ago, going by its id (see :mod:`stargrpc.ids`): a run without
        an idempotency key reaches Redis with its first flush, a few milliseconds after its
        START — which its caller may already have passed on to a watcher on this replica.
        Blocks on the run's event stream (XREAD), at most until the first flush could still
        be landing (the call's and a flush's timeout, and a second for the clocks of two
        hosts); whether an event came. An id of another form, or an older one, is not
        waited for."""
        minted = minted_ms(run_id)
        # Anyone may name a fresh-looking id of a run that does not exist: each wait holds a
        # Redis connection, so only so many wait at once; the rest are answered at once.
        waiter = current_principal.get().id
        held = self._fresh_waits_by.get(waiter, 0)
        if (minted is None or self._fresh_waits >= MAX_FRESH_RUN_WAITS
                or held >= MAX_FRESH_RUN_WAITS_PER_PRINCIPAL):
            return False
        self._fresh_waits += 1
        self._fresh_waits_by[waiter] = held + 1
        try:
            return await self._first_event_within(run_id, minted)
        finally:
            self._fresh_waits -= 1
            left = self._fresh_waits_by[waiter] - 1
            if left:
                self._fresh_waits_by[waiter] = left
            else:
                del self._fresh_waits_by[waiter]

    async def _first_event_within(self, run_id: str, minted: int) -> bool:
        shared = self.shared
        window_ms = int((shared.timeout + shared.flush_timeout + 1.0) * 1000)
        until = time.monotonic() + min(window_ms, minted + window_ms - time.time() * 1000) / 1000
        key = shared.key(run_id, "events")
        while (left := until - time.monotonic()) > 0:
            # In slices: a blocking read must end within the client's socket timeout.
            reply = await shared.redis.xread({key: "0-0"}, count=1,
                                             block=max(1, min(int(left * 1000), shared.block_ms)))
            if reply:
                return True
        return False

    async def publish(self, log: RunLog) -> None:
        # No round trip: the run is registered by its claim or by its first flush.
        assert isinstance(log, RedisRunLog)
        shared = self.shared
        log.deadline = time.monotonic() + shared.timeout
        if not shared.healthy:
            try:
                # The deadline outside reachable(): running out of it is told as such, not
                # as a timeout of redis-py's (which reachable() reports as Redis unreachable).
                async with asyncio.timeout(shared.timeout):
                    with reachable("registering the run"):
                        await shared.redis.ping()
            except TimeoutError as exc:
                raise request_error(exc, "registering the run") from exc
            shared.answered()
        shared.runs.add(log)
        log.start_flushing()
        if self._renewer is None or self._renewer.done():
            self._renewer = asyncio.create_task(self._renew_loop(), name="redis-lease-renewal")

    async def register(self, log: RunLog) -> None:
        # Before the run starts, as a claim registers it: a replica that learns of the run
        # from then on (a delivery to take over) finds it, and ends it RUN_LOST if this
        # replica dies. Void when Redis applies it after the call's deadline.
        assert isinstance(log, RedisRunLog)
        await self.claims.register(log)

    async def claim(self, owner: str, key: str, fingerprint: str, log: RunLog) -> Claim:
        assert isinstance(log, RedisRunLog)
        return await self.claims.claim(owner, key, fingerprint, log)

    async def discard(self, log: RunLog) -> None:
        shared = self.shared
        shared.runs.forget(log.run_id)
        self.flusher.drop(log.run_id)
        if isinstance(log, RedisRunLog) and not log.registered:
            return  # never reached Redis (it lost its claim): nothing to delete
        with reachable("discarding the run"):
            # One key per command: a DEL of several is refused (TRYAGAIN) while the run's
            # slot is being moved with only some of them on the node.
            async with shared.redis.pipeline(transaction=False) as pipe:
                for part in ("", "lease", "events"):
                    pipe.delete(shared.key(log.run_id, part))
                await pipe.execute()

    async def request_cancel(self, run_id: str, reason: str) -> bool:
        shared = self.shared
        if run_id in shared.runs and shared.cancel_handler is not None:
            return shared.cancel_handler(run_id, reason)
        with reachable("requesting the cancel"):
            if await self.leases.state(run_id) != "running":
                return False
            # The replica running it sees this at its next lease renewal (about a second).
            await shared.redis.set(shared.key(run_id, "cancel"), reason,
                                   px=shared.running_ttl_ms)
        return True

    async def request_steer(self, run_id: str, message: str, source: str) -> None:
        shared = self.shared
        if run_id in shared.runs:
            if shared.steer_handler is None or not shared.steer_handler(run_id, message, source):
                raise run_finished_error(run_id)
            return
        payload = json.dumps({"message": message, "source": source})
        with reachable("steering the run"):
            # The replica running it picks this up at its next lease renewal (about a
            # second). The script names the steer list, which mostly does not exist yet: while
            # the run's slot moves, Redis refuses it (TRYAGAIN) without running it, so it is
            # sent again until the slot has moved or the call's time is up.
            deadline = time.monotonic() + shared.timeout
            while True:
                try:
                    left = await shared.scripts.steer(
                        keys=[shared.key(run_id), shared.key(run_id, "steer")],
                        args=[shared.max_pending_steers, payload, shared.running_ttl_ms])
                    break
                except SLOT_MOVING:
                    if time.monotonic() + SLOT_MOVING_RETRY_SECONDS >= deadline:
                        raise
                    await asyncio.sleep(SLOT_MOVING_RETRY_SECONDS)
        if left == -1:
            raise run_finished_error(run_id)
        if left == 0:
            raise ResourceExhausted(
                f"the run already holds {shared.max_pending_steers} unread steering messages",
                retry_after=RETRY_AFTER_SECONDS, reason=reason_name(errors_pb2.STEER_QUEUE_FULL),
                metadata={"run_id": run_id})

    async def list_runs(self, query: RunQuery) -> RunPage:
        return await self.index.list_runs(query)

    async def page_token_key(self) -> bytes:
        return await self.index.page_token_key()

    async def count_tree_runs(self, root_run_id: str, delta: int, ttl_ms: int) -> int | None:
        return await self.index.count_tree_runs(root_run_id, delta, ttl_ms)

    async def flushed(self, within: float) -> bool:
        """Waits until every event appended so far is in Redis, at most ``within`` seconds;
        whether it is."""
        return await self.flusher.flushed(within)

    async def start(self) -> None:
        """Starts sweeping for lost runs in the background (see :mod:`stargrpc.stores.redis`)
        and probing whether Redis answers (after a first PING, bounded by the timeout): the
        server calls it when it starts, whether or not this replica runs anything."""
        self.sweep.start()
        await self.shared.reachability.start()

    async def aclose(self) -> None:
        """Flushes what runs of this replica still hold, stops renewing and sweeping,
        disconnects."""
        await self.flushed(5.0)
        if self.lanes is not None:
            await self.lanes.aclose()
        await self.stop_renewing()
        await self.flusher.aclose()
        await self.sweep.stop()
        await self.shared.reachability.stop()
        await self.index.aclose()
        await self.shared.redis.aclose()

    async def stop_renewing(self) -> None:
        """Stops renewing the leases of this replica's runs (and undoing abandoned claims)."""
        task, self._renewer = self._renewer, None
        await stop_background(task, "lease-renewal")

    async def _renew_loop(self) -> None:
        interval = min(1.0, self.shared.lease_ms / 3000)
        while True:
            await asyncio.sleep(interval)
            try:
                # Abandoned claims first, then every run's lease in one round trip.
                await self.claims.undo_abandoned()
                await self.leases.renew_once(fence=self.flusher.fence)
            except Exception:  # one bad round must not end the renewal of every run
                log.exception("redis_lease_renewal_error")
