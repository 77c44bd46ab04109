"""Leases and lost runs: renewing the leases of this replica's runs (and handing them what
other replicas left for them), telling a run's state, ending a run whose replica stopped
renewing (``Result{ERROR, RUN_LOST}``), and the background sweep of ``runs:running`` that
does so whether or not anybody watches the run."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from typing import Any

import structlog
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ClusterError, RedisError, ResponseError

from stargrpc import metrics
from stargrpc.errors import RequestError
from stargrpc.stores.background import stop_background
from stargrpc.stores.redis.errors import as_redis_error
from stargrpc.stores.redis.logs import RedisRunLog
from stargrpc.stores.redis.shared import Shared
from stargrpc.v1 import events_pb2

log = structlog.get_logger("stargrpc.stores.redis")

#: Most runs one sweep for lost runs takes from ``runs:running`` (a fuller set is swept on
#: at once, batch by batch).
SWEEP_MAX_RUNS = 256
#: The message of the Result of a run whose replica stopped responding.
LOST_MESSAGE = ("the replica running this run stopped responding; retry with the same "
                "idempotency key to run it again")


def error_result(run_id: str, seq: int, code: str, message: str) -> bytes:
    """The bytes of a run's terminal event ``Result{ERROR, code}`` written by the store
    (not by the run): a lost run's, a conflicting one's, an abandoned claim's."""
    event = events_pb2.RunEvent(run_id=run_id, seq=seq)
    event.time.GetCurrentTime()
    event.result.outcome = events_pb2.OUTCOME_ERROR
    event.result.error.code = code
    event.result.error.message = message
    return event.SerializeToString()


class Leases:
    """The leases of runs: this replica's renewed, anyone's looked at and ended when lost."""

    _shared: Shared

    def __init__(self, shared: Shared) -> None:
        self._shared = shared

    # What a RemoteRunLog asks of the store (logs.RunLookup).

    @property
    def redis(self) -> Redis | RedisCluster:
        return self._shared.redis

    @property
    def block_ms(self) -> int:
        return self._shared.block_ms

    @property
    def lease_ms(self) -> int:
        return self._shared.lease_ms

    def events_key(self, run_id: str) -> str:
        """The key of a run's event stream."""
        return self._shared.key(run_id, "events")

    async def state(self, run_id: str) -> str:
        """running | finished | lost | orphaned (running, lease expired) | missing."""
        shared = self._shared
        async with shared.redis.pipeline(transaction=False) as pipe:
            pipe.hget(shared.key(run_id), "state")
            pipe.exists(shared.key(run_id, "lease"))
            state, leased = await pipe.execute()
        if state is None:
            return "missing"
        if state == b"running":
            return "running" if leased else "orphaned"
        return str(state.decode())

    async def end_if_lost(self, run_id: str) -> None:
        """Appends ``Result{ERROR, RUN_LOST}`` to a run whose replica stopped renewing its
        lease without writing a Result, once the lease has stayed lapsed for a whole lease
        period (see :data:`~stargrpc.stores.redis.scripts.END`); does nothing to a live or
        finished run."""
        if await self.state(run_id) == "orphaned":
            await self.end(run_id, "RUN_LOST", LOST_MESSAGE, noticed_by="call")

    async def end(self, run_id: str, code: str, message: str, token: str = "",
                  **seen: str) -> bool:
        """Appends a terminal ``Result{ERROR, code}`` after the events in Redis: to a lost
        run (``token`` empty), or to a run of this replica holding the lease ``token``.
        Whether it was appended. ``seen`` goes into the log line (what the sweep knew).

        Raises:
            RedisError: Redis could not be reached, or refused the script.
        """
        shared = self._shared
        for _ in range(5):
            last: Any = await shared.redis.xrevrange(shared.key(run_id, "events"), count=1)
            last_id = last[0][0].decode() if last else "0-0"
            seq = int(last_id.split("-", 1)[0]) + 1
            done = await shared.scripts.call(shared.scripts.end, shared.run_keys(run_id), [
                last_id, f"{seq}-0", error_result(run_id, seq, code, message),
                shared.retention_ms, token, shared.lease_ms,
                "lost" if code == "RUN_LOST" else "finished"])
            if done != -2:  # -2: an event landed in between; look again
                if done == 1:
                    log.warning("run_lost" if code == "RUN_LOST" else "run_ended_in_store",
                                run_id=run_id, code=code, **seen)
                    if code == "RUN_LOST":
                        metrics.RUNS_LOST.labels(seen.get("noticed_by", "call")).inc()
                    await self._unlist(run_id)
                return bool(done == 1)
        return False

    async def _unlist(self, run_id: str) -> None:
        """Takes a run that has its Result out of the sweep's set at once, whoever ended it
        (a watcher, a delivery, the sweep): a reader of the set never sees it running. Best
        effort: an entry left behind is removed at the sweep's next look."""
        shared = self._shared
        try:
            await shared.redis.zrem(shared.running_key, run_id)
        except RedisError as exc:
            log.warning("redis_sweep_set_not_updated", run_id=run_id, error=str(exc))

    async def renew_once(self, fence: Callable[[RedisRunLog], None]) -> None:
        """Renews the lease of every run of this replica (in one round trip) and hands over
        what other replicas left for them; a run whose lease another replica took (it
        declared the run lost) is given to ``fence``."""
        shared = self._shared
        scripts = shared.scripts
        # An unregistered run has no lease yet: its first flush sets it.
        runs = [run_log for run_log in shared.runs
                if run_log.registered and not run_log.finished]
        if not runs:
            return
        try:  # every run's renewal in one round trip
            replies = await scripts.call_all(scripts.renew, [(
                self._renew_keys(run_log),
                [shared.token(run_log.run_id), shared.lease_ms, shared.running_ttl_ms,
                 shared.replica, run_log.claim_value],
            ) for run_log in runs])
            if shared.cluster:
                renewed = [(i, run_log) for i, (run_log, reply)
                           in enumerate(zip(runs, replies, strict=True))
                           if not isinstance(reply, Exception) and reply[0] != -1]
                claimed = [run_log for _, run_log in renewed if run_log.claim_key]
                if claimed:  # a cluster keeps their claims, in their own slots, alike
                    await scripts.call_all(scripts.renew_claim, [
                        ([run_log.claim_key], [run_log.claim_value, shared.running_ttl_ms])
                        for run_log in claimed])
                for (i, _), reply in zip(renewed, await self._pending_for(
                        [run_log for _, run_log in renewed]), strict=True):
                    replies[i] = reply
        except RedisError as exc:
            shared.failed(exc)
            log.warning("redis_lease_renewal_failed", error=str(exc))
            return
        for run_log, reply in zip(runs, replies, strict=True):
            if isinstance(reply, Exception):
                log.warning("redis_lease_renewal_failed", run_id=run_log.run_id,
                            error=str(reply))
                continue
            if reply[0] == -1:
                if not run_log.lease_lost:
                    fence(run_log)
                continue
            if reply[0] == 1 and shared.cancel_handler is not None:
                shared.cancel_handler(run_log.run_id, reply[1].decode(errors="replace"))
            for payload in reply[2:]:
                self._hand_over_steer(run_log.run_id, payload)

    def _renew_keys(self, run_log: RedisRunLog) -> list[str]:
        """The keys of a run's renewal call: on a cluster only those a running run has (see
        :data:`~stargrpc.stores.redis.scripts.RENEW`)."""
        shared = self._shared
        keys = shared.run_keys(run_log.run_id)
        if shared.cluster:
            return keys
        return shared.with_claim([*keys, shared.key(run_log.run_id, "cancel"),
                                  shared.key(run_log.run_id, "steer")], run_log.claim_key)

    async def _pending_for(self, runs: list[RedisRunLog]) -> list[list[Any]]:
        """On a cluster, after their leases were renewed: each run's pending cancel and
        steering messages, as the renewal script reports them on one Redis. Single-key
        commands, which a node serves (or redirects with ASK) while the run's slot is being
        moved."""
        if not runs:
            return []
        shared = self._shared
        with as_redis_error():
            async with shared.redis.pipeline(transaction=False) as pipe:
                for run_log in runs:
                    pipe.get(shared.key(run_log.run_id, "cancel"))
                    pipe.lpop(shared.key(run_log.run_id, "steer"), shared.max_pending_steers)
                found: list[Any] = list(await pipe.execute(raise_on_error=False))
        replies: list[list[Any]] = []
        for run_log, reason, steers in zip(runs, found[::2], found[1::2], strict=True):
            for error in (e for e in (reason, steers) if isinstance(e, Exception)):
                log.warning("redis_cancel_or_steer_not_read", run_id=run_log.run_id,
                            error=str(error))
            reason = None if isinstance(reason, Exception) else reason
            steers = [] if isinstance(steers, Exception) or steers is None else steers
            replies.append([1 if reason is not None else 0, reason or b"", *steers])
        return replies

    def _hand_over_steer(self, run_id: str, payload: bytes) -> None:
        """Steers a run of this replica with a message another replica left for it."""
        try:
            steer = json.loads(payload)
            if self._shared.steer_handler is not None:
                self._shared.steer_handler(run_id, str(steer["message"]), str(steer["source"]))
        except (RequestError, ValueError, KeyError, TypeError) as exc:
            # Checked on the other replica already; what fails now (the run ended, or its
            # queue filled up meanwhile) has no caller left to tell.
            log.warning("steer_not_handed_over", run_id=run_id, error=str(exc))


class Sweep:
    """The sweep for lost runs: every replica looks at the runs of ``runs:running`` that
    are due, about every ``interval`` seconds (jittered), whether or not it runs anything.

    Attributes:
        interval: Seconds between two sweeps (on average three quarters of it: jittered),
            at most a quarter of the lease.
    """

    interval: float
    _shared: Shared
    _leases: Leases
    _task: asyncio.Task[None] | None

    def __init__(self, shared: Shared, leases: Leases, interval: float) -> None:
        self._shared = shared
        self._leases = leases
        self.interval = max(0.01, min(interval, shared.lease_ms / 4000))
        self._task = None

    @property
    def key(self) -> str:
        """The set of running runs the sweep looks at."""
        return self._shared.running_key

    @property
    def running(self) -> bool:
        """Whether the sweep goes on in the background."""
        return self._task is not None and not self._task.done()

    def commands(self, run_log: RedisRunLog) -> list[tuple[Any, ...]]:
        """What puts a run just registered into ``runs:running`` (the sweep looks at it once
        its lease could have lapsed), or takes a run whose Result is in Redis out."""
        shared = self._shared
        key = self.key
        if run_log.finished and not run_log.has_pending:  # the Result written (or fenced)
            # A run registered with its Result (most short runs) was never put in.
            return [("ZREM", key, run_log.run_id)] if run_log.swept else []
        run_log.swept = True
        due = int(time.time() * 1000) + shared.clock_ahead_ms + shared.lease_ms
        return [("ZADD", key, due, run_log.run_id), ("PEXPIRE", key, shared.running_ttl_ms)]

    def start(self) -> None:
        """Starts sweeping in the background, unless it already does."""
        if not self.running:
            self._task = asyncio.create_task(self._loop(), name="redis-run-sweep")

    async def stop(self) -> None:
        """Stops sweeping."""
        task, self._task = self._task, None
        await stop_background(task, "sweep")

    async def _loop(self) -> None:
        # Jittered, so that replicas started together do not sweep in step; never past the
        # interval, which the bound on declaring a run lost counts with.
        this = asyncio.current_task()
        while self._task is this:
            await asyncio.sleep(self.interval * (0.5 + random.random() / 2))
            more = True
            while more:  # a full batch: more are due, taken batch by batch
                more = False
                try:
                    # Bounded: a stalled Redis holds a round trip until it resumes when the
                    # client has no socket timeout of its own.
                    async with asyncio.timeout(4 * self._shared.flush_timeout):
                        with as_redis_error():
                            more = await self.sweep_once() == SWEEP_MAX_RUNS
                except (RedisError, TimeoutError) as exc:
                    log.warning("redis_sweep_failed", error=str(exc) or "no answer in time")
                except Exception:  # one bad sweep must not end the sweeping
                    log.exception("redis_sweep_error")

    async def sweep_once(self) -> int:
        """Looks at the runs of ``runs:running`` that are due (at most
        :data:`SWEEP_MAX_RUNS`): ends those whose lease has stayed lapsed for the grace,
        takes finished and expired ones out, and puts the others back for when they are due
        again. How many it took.

        Raises:
            RedisError: Redis could not be reached (the runs taken are due again a lease
                later, for any sweeper).
        """
        shared = self._shared
        key = self.key
        taken: Any = await shared.scripts.sweep_take(
            keys=[key], args=[SWEEP_MAX_RUNS, shared.lease_ms, shared.running_ttl_ms])
        now_ms, run_ids = int(taken[0]), [raw.decode() for raw in taken[1:]]
        if not run_ids:
            return 0
        async with shared.redis.pipeline(transaction=False) as pipe:
            for run_id in run_ids:
                pipe.hmget(shared.key(run_id), "state", "lapsed", "replica", "tool")
                pipe.pttl(shared.key(run_id, "lease"))
            found: list[Any] = list(await pipe.execute(raise_on_error=False))
        due: dict[str, int] = {}  # run id -> when to look again (ms, Redis's clock)
        gone: list[str] = []
        for run_id, meta, ttl in zip(run_ids, found[::2], found[1::2], strict=True):
            if isinstance(meta, Exception) or isinstance(ttl, Exception):
                log.warning("redis_sweep_failed", run_id=run_id, error=str(
                    meta if isinstance(meta, Exception) else ttl))
                continue  # taken: due again a lease later
            state, lapsed, replica, tool = meta
            if state != b"running":  # finished, lost or expired
                gone.append(run_id)
            elif ttl != -2:  # leased: looked at again when it could lapse
                due[run_id] = now_ms + (ttl if ttl >= 0 else shared.lease_ms)
            elif (local := shared.runs.get(run_id)) is not None and not local.lease_lost:
                # Running here: its next renewal takes the lease back (Redis stalled).
                due[run_id] = now_ms + int(self.interval * 1000)
            elif lapsed is not None and now_ms < int(lapsed) + shared.lease_ms:
                due[run_id] = int(lapsed) + shared.lease_ms  # in its grace
            elif await self._end(run_id, replica, tool):
                gone.append(run_id)
            else:  # just seen lapsed (its grace starts now), or its lease was taken back
                due[run_id] = now_ms + int(self.interval * 1000)
        async with shared.redis.pipeline(transaction=False) as pipe:
            for run_id, at in due.items():
                pipe.zadd(key, {run_id: at}, xx=True)  # unless it ended meanwhile
            if gone:
                pipe.zrem(key, *gone)
            await pipe.execute(raise_on_error=False)
        return len(run_ids)

    async def _end(self, run_id: str, replica: bytes | None, tool: bytes | None) -> bool:
        """Ends a run the sweep found lapsed, if it has stayed lapsed for the grace (the
        first sighting starts it); whether it was ended. A refusal of this run's script (its
        slot being moved) is logged and left for the next look.

        Raises:
            RedisError: Redis could not be reached.
        """
        try:
            return await self._leases.end(run_id, "RUN_LOST", LOST_MESSAGE, noticed_by="sweep",
                                          replica=(replica or b"").decode(errors="replace"),
                                          tool=(tool or b"").decode(errors="replace"))
        except (ResponseError, ClusterError) as exc:
            log.warning("redis_sweep_failed", run_id=run_id, error=str(exc))
            return False
