"""What every room of the Redis store reads: its client and scripts, its key layout and
limits, this replica's id and runs, and what it learns as it goes (whether Redis answers,
how far Redis's clock runs ahead of this host's)."""

from __future__ import annotations

import os
import socket
import time
import uuid

import structlog
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MaxConnectionsError
from redis.exceptions import TimeoutError as RedisTimeoutError

from stargrpc.stores.base import CancelHandler, SteerHandler
from stargrpc.stores.keys import KeyLayout
from stargrpc.stores.redis.errors import NotReplicated
from stargrpc.stores.redis.logs import LocalRuns
from stargrpc.stores.redis.reachability import Reachability
from stargrpc.stores.redis.scripts import Scripts

log = structlog.get_logger("stargrpc.stores.redis")


class Shared:
    """The store's client, settings and state that its rooms share.

    Attributes:
        redis: The client.
        cluster: Whether ``redis`` is a Redis Cluster client (then claims take two steps).
        keys: The key layout (hash-tagged on a cluster).
        prefix: Prefix of every key.
        scripts: The store's scripts, registered on ``redis``.
        replica: This replica's id, recorded with the runs it executes.
        runs: The runs executing on this replica.
        retention_ms: How long a finished run stays in Redis.
        lease_ms: A run's lease.
        max_events: Events a run's stream keeps at most.
        block_ms: Longest a blocking read waits in one call.
        timeout: Longest a call waits for Redis before the run starts.
        flush_timeout: Longest a flusher round trip may take before it counts as failed.
        max_pending_steers: Steering messages left for another replica's run at most.
        healthy: False until Redis has answered, and again after a background write failed:
            then a new run without a key (which would reach Redis only after it started) is
            refused unless a PING gets through.
        reachability: Whether Redis answers, as the server's health reports it (a PING
            probe and this replica's background writes).
        clock_ahead_ms: How far Redis's clock runs ahead of this host's, as last seen by a
            claim.
        cancel_handler: Set by the runtime; stops a run of this process.
        steer_handler: Set by the runtime; steers a run of this process.
    """

    redis: Redis | RedisCluster
    cluster: bool
    keys: KeyLayout
    prefix: str
    scripts: Scripts
    replica: str
    runs: LocalRuns
    retention_ms: int
    lease_ms: int
    max_events: int
    block_ms: int
    timeout: float
    flush_timeout: float
    max_pending_steers: int
    healthy: bool
    reachability: Reachability
    clock_ahead_ms: int
    cancel_handler: CancelHandler | None
    steer_handler: SteerHandler | None

    def __init__(self, redis: Redis | RedisCluster, *, prefix: str, retention: float,
                 lease: float, max_events: int, block_seconds: float, flush_timeout: float,
                 timeout: float, wait_replicas: int, wait_timeout_ms: int,
                 max_pending_steers: int, probe_interval: float = 1.0) -> None:
        self.redis = redis
        self.cluster = isinstance(redis, RedisCluster)
        self.keys = KeyLayout(prefix, tagged=self.cluster)
        self.prefix = prefix
        self.scripts = Scripts(redis, wait_replicas=wait_replicas,
                               wait_timeout_ms=wait_timeout_ms)
        self.replica = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.runs = LocalRuns()
        self.retention_ms = max(1, int(retention * 1000))
        self.lease_ms = int(lease * 1000)
        self.max_events = max_events
        self.block_ms = max(10, int(block_seconds * 1000))
        self.timeout = timeout
        self.flush_timeout = flush_timeout
        self.max_pending_steers = max_pending_steers
        self.healthy = False
        self.reachability = Reachability(redis, interval=probe_interval, timeout=timeout)
        self.clock_ahead_ms = 0
        self.cancel_handler = None
        self.steer_handler = None

    # -- keys ------------------------------------------------------------------------------

    def key(self, run_id: str, part: str = "") -> str:
        """The key of a run's meta hash, or of its ``part`` (events, lease, cancel, steer)."""
        return self.keys.run(run_id, part)

    @property
    def running_key(self) -> str:
        """The set of running runs the sweep looks at (``runs:running``)."""
        return f"{self.prefix}runs:running"

    def run_keys(self, run_id: str) -> list[str]:
        """The keys of a run as the scripts take them: lease, events, meta."""
        return self.keys.run_keys(run_id)

    def with_claim(self, keys: list[str], claim_key: str) -> list[str]:
        """``keys`` and the claim key, where one script may touch both (one Redis)."""
        return [*keys, claim_key] if claim_key and not self.cluster else keys

    def token(self, run_id: str) -> str:
        """The lease this replica holds on a run of its own."""
        return f"{self.replica}/{run_id}"

    @property
    def running_ttl_ms(self) -> int:
        """The TTL of a running run's keys, pushed out as it goes."""
        return self.retention_ms + self.lease_ms

    # -- what the store learns ---------------------------------------------------------------

    def failed(self, exc: BaseException) -> None:
        """Notes a failed write: when Redis was unreachable, new runs without a key are
        refused until a PING gets through, and the server's health is NOT_SERVING until
        Redis answers again (a full pool is load, not an outage)."""
        if isinstance(exc, (RedisConnectionError, RedisTimeoutError, TimeoutError)) and \
                not isinstance(exc, MaxConnectionsError):
            self.healthy = False
            if not isinstance(exc, NotReplicated):  # Redis answered; its replicas lag
                self.reachability.unanswered(str(exc) or "no answer in time")

    def answered(self) -> None:
        """Notes a write (or PING) Redis answered."""
        self.healthy = True
        self.reachability.answered()

    def deadline_ms(self, deadline: float) -> int:
        """A call's ``deadline`` (monotonic) by Redis's clock, in ms since the epoch."""
        remaining = deadline - time.monotonic()
        return int((time.time() + remaining) * 1000) + self.clock_ahead_ms

    def clock_ran_ahead(self, redis_ms: int) -> bool:
        """Whether Redis's time ``redis_ms`` (a claim's too-late answer) shows its clock
        further ahead of this host's than known: then it is counted with from now on (and
        the claim was not late). False: the claim was late."""
        ahead = redis_ms - int(time.time() * 1000)
        if ahead <= self.clock_ahead_ms:
            return False
        log.warning("redis_clock_ahead", ahead_ms=ahead,
                    detail="Redis's clock runs ahead of this host's; claims allow for it")
        self.clock_ahead_ms = ahead
        return True
