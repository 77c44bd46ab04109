"""The flusher: one task that writes the pending events of every run of this replica to
Redis, in batches, one pipeline of script calls per round trip — and stops writing a run
that another replica declared lost, or whose stream holds another event than it wrote."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import structlog
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from stargrpc.stores.background import stop_background
from stargrpc.stores.redis.connection import FlushConnection
from stargrpc.stores.redis.errors import SLOT_MOVING
from stargrpc.stores.redis.index import RunIndex
from stargrpc.stores.redis.leases import Leases
from stargrpc.stores.redis.logs import RedisRunLog
from stargrpc.stores.redis.shared import Shared

log = structlog.get_logger("stargrpc.stores.redis")

#: How long the flusher waits for more events before it writes, unless a Result is waiting:
#: a short call's START, END and Result then go in one script call instead of two or three.
FLUSH_LINGER = 0.002
#: The longest the flusher waits to write again while a run's slot is being moved.
_SLOT_MOVING_FLUSH_DELAY_CAP = 0.2

Batch = list[tuple[int, bytes, bool]]


class Flusher:
    """Writes the events of this replica's runs to their Redis streams, in order.

    Attributes:
        line: The flusher's own connection (one Redis); None on a cluster, whose writes go
            to the node of each run's slot through the client's pipeline.
    """

    line: FlushConnection | None
    _shared: Shared
    _leases: Leases
    _index: RunIndex
    _dirty: dict[str, RedisRunLog]
    _flush_now: asyncio.Event
    _linger: asyncio.TimerHandle | None
    _flushed: asyncio.Event
    _task: asyncio.Task[None] | None
    _slot_moving: bool

    def __init__(self, shared: Shared, leases: Leases, index: RunIndex) -> None:
        self._shared = shared
        self._leases = leases
        self._index = index
        redis = shared.redis
        self.line = None if isinstance(redis, RedisCluster) else FlushConnection(redis)
        # Runs with events to write. One flusher writes them all, one pipeline of script
        # calls per round trip, so concurrent runs share round trips and a connection.
        self._dirty = {}
        self._flush_now = asyncio.Event()
        self._linger = None
        self._flushed = asyncio.Event()
        self._task = None
        # Whether the last flush failed (partly) because a cluster was moving a slot.
        self._slot_moving = False

    def wants_flush(self, run_log: RedisRunLog) -> None:
        """Writes the pending events of ``run_log`` (now for a Result, else shortly)."""
        self._dirty[run_log.run_id] = run_log
        self._flushed.clear()
        self._schedule(urgent=run_log.finished)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop(), name="redis-flush")

    def drop(self, run_id: str) -> None:
        """Writes nothing more of a run (discarded)."""
        self._dirty.pop(run_id, None)

    async def flushed(self, within: float) -> bool:
        """Waits until every event appended so far is in Redis, at most ``within`` seconds;
        whether it is."""
        if self._task is None or self._task.done():
            return not self._dirty
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._flushed.wait(), within)
        return self._flushed.is_set()

    async def stop(self) -> None:
        """Stops writing (what is pending stays pending)."""
        task, self._task = self._task, None
        await stop_background(task, "flush")
        if self._linger is not None:
            self._linger.cancel()

    async def aclose(self) -> None:
        """Stops writing and closes the flusher's connection; the runs whose events did not
        all reach the store are logged (it holds them cut short: no Result, and their
        idempotency keys held until the store's sweep declares them lost)."""
        await self.stop()
        cut_short = sorted(run_id for run_id, run_log in self._dirty.items()
                           if run_log.has_pending and not run_log.lease_lost)
        if cut_short:
            log.error("redis_runs_not_flushed", run_ids=cut_short[:100], runs=len(cut_short),
                      detail="the run store did not take their last events before shutdown")
        if self.line is not None:
            await self.line.aclose()

    def fence(self, run_log: RedisRunLog) -> None:
        """Fences a run whose lease this replica no longer holds (another replica declared
        it lost, or the store lost its keys): this replica writes nothing more of it and
        stops it with ``Result{ERROR, RUN_LOST}``, so that a retry with its key (which now
        runs the tool again) never runs beside it."""
        log.error("run_lease_lost", run_id=run_log.run_id,
                  detail="the run store no longer holds this replica's lease on the run: "
                  "another replica declared it lost, or the store lost its data (restarted "
                  "without persistence, flushed, or evicted the keys); stopping it here")
        self._stop_writing(run_log)
        cancel = self._shared.cancel_handler
        if cancel is not None:
            cancel(run_log.run_id, "the run store no longer holds this run's lease (declared "
                   "lost, or the store lost its data); retry with the same idempotency key",
                   "RUN_LOST")

    def _stop_writing(self, run_log: RedisRunLog) -> None:
        run_log.stop_writing()
        self._dirty.pop(run_log.run_id, None)
        self._shared.runs.forget(run_log.run_id)

    def _schedule(self, *, urgent: bool) -> None:
        """Wakes the flusher now (a Result: its caller may watch it on another replica), or
        after a short linger that lets more events of this and other runs join the round
        trip. A timer rather than a wake-up: the flusher runs once per round trip, not once
        per event."""
        if urgent:
            self._flush_now.set()
        elif self._linger is None and not self._flush_now.is_set():
            self._linger = asyncio.get_running_loop().call_later(FLUSH_LINGER,
                                                                 self._flush_now.set)

    async def _loop(self) -> None:
        delay = 0.05
        while True:
            await self._flush_now.wait()
            self._flush_now.clear()
            if self._linger is not None:
                self._linger.cancel()
                self._linger = None
            logs, self._dirty = self._dirty, {}
            self._slot_moving = False
            try:
                flushed = await self._flush(list(logs.values()))
            except BaseException as exc:
                # What the round trip carried is still to write (and, stopped, to tell).
                for run_log in logs.values():
                    self._dirty.setdefault(run_log.run_id, run_log)
                if not isinstance(exc, Exception):
                    raise  # stopped (cancelled)
                # The flusher writes every run's events: it must go on.
                log.exception("redis_flush_error")
                flushed = False
            if flushed:
                delay = 0.05
            else:
                await asyncio.sleep(delay)
                # Redis down or stalled: back off. A slot being moved: Redis answers, and
                # the run's writes go through again as soon as its keys are on one node.
                delay = min(delay * 2,
                            _SLOT_MOVING_FLUSH_DELAY_CAP if self._slot_moving else 2.0)
            if self._dirty:
                self._schedule(urgent=any(log.finished for log in self._dirty.values()))
            else:
                self._flushed.set()

    async def _flush(self, logs: list[RedisRunLog]) -> bool:
        """Writes the next batch of each log, in one round trip; False when some failed
        (their events are kept, to be written again)."""
        shared = self._shared
        batches = [(run_log, run_log.next_batch()) for run_log in logs
                   if run_log.has_pending and not run_log.lease_lost]
        if not batches:
            return True
        # Runs this round trip registers or ends go into (or stay in) the ListRuns indexes.
        to_index = [run_log for run_log, batch in batches
                    if not run_log.registered or batch[-1][2]]
        # A run registered without its Result enters the sweep's set with its registration
        # (RunIndex.sweep_commands says why and how).
        swept = self._index.sweep_commands([run_log for run_log, batch in batches
                                            if not run_log.registered and not batch[-1][2]])
        # Whatever fails is kept and written again: local readers are unaffected, remote
        # watchers wait, and the lease (renewed by these writes) is at stake.
        try:
            async with asyncio.timeout(shared.flush_timeout):
                replies = await shared.scripts.call_all(shared.scripts.append, [
                    self._append_call(run_log, batch) for run_log, batch in batches],
                    self.line, durable=True, before=swept)
        except (RedisError, TimeoutError) as exc:
            shared.failed(exc)
            log.warning("redis_flush_failed", runs=len(batches),
                        error=str(exc) or "no answer in time")
            self._dirty.update((run_log.run_id, run_log) for run_log, _ in batches)
            return False
        ok = True
        for (run_log, batch), reply in zip(batches, replies, strict=True):
            if isinstance(reply, Exception):
                shared.failed(reply)
                if isinstance(reply, SLOT_MOVING):
                    self._slot_moving = True
                    log.info("redis_flush_deferred", run_id=run_log.run_id,
                             detail="the run's slot is being moved; written again shortly",
                             error=str(reply))
                else:
                    log.warning("redis_flush_failed", run_id=run_log.run_id,
                                error=str(reply))
                self._dirty[run_log.run_id] = run_log
                ok = False
                continue
            shared.answered()
            run_log.registered = True
            if reply[0] == -1:
                self.fence(run_log)
                continue
            if reply[0] == -3:
                await self._conflict(run_log, int(reply[1]))
                continue
            if reply[0] == -4:  # a failover lost events Redis had acknowledged
                log.warning("redis_events_rewritten", run_id=run_log.run_id,
                            from_seq=int(reply[1]) + 1, to_seq=batch[0][0] - 1,
                            detail="a failover lost them; written again from this replica")
                run_log.resend_from(int(reply[1]) + 1)
                self._dirty[run_log.run_id] = run_log
                continue
            run_log.written(len(batch))
            if batch[-1][2]:  # the Result is in Redis: done
                shared.runs.forget(run_log.run_id)
            elif run_log.has_pending:
                self._dirty[run_log.run_id] = run_log
        await self._index.add([run_log for run_log in to_index if run_log.registered],
                              self.line)
        return ok

    def _append_call(self, run_log: RedisRunLog, batch: Batch) -> tuple[list[str], list[Any]]:
        """The keys and arguments of the append script call writing ``batch``."""
        shared = self._shared
        args: list[Any] = [shared.token(run_log.run_id), shared.lease_ms, shared.max_events,
                           "1" if batch[-1][2] else "0", shared.retention_ms,
                           shared.running_ttl_ms]
        if run_log.registered:
            args.extend(("0", "", "", shared.replica))
        else:
            args.extend(("1", run_log.owner, run_log.tool, shared.replica))
        final = batch[-1][2]
        summary = {"seq": batch[-1][0], "step": "" if final else run_log.current_step}
        if final:
            summary.update(outcome=run_log.outcome, ended=run_log.ended_ms)
        if run_log.parent_run_id:  # a run below a root (ListRuns, a child's parent lookup)
            summary.update(parent=run_log.parent_run_id, root=run_log.root_run_id,
                           depth=run_log.depth)
        if run_log.lane:  # ListRuns shows (and filters on) every run's lane
            summary.update(lane=run_log.lane, priority=run_log.priority)
        args.extend((json.dumps(summary), batch[0][0]))
        args.extend(data for _, data, _ in batch)
        return shared.with_claim(shared.run_keys(run_log.run_id), run_log.claim_key), args

    async def _conflict(self, run_log: RedisRunLog, seq: int) -> None:
        """Fails a run closed whose stream holds another event at ``seq`` than this replica
        wrote there: it stops, and its stream in Redis ends with ``Result{ERROR,
        STORE_CONFLICT}`` so that no watcher waits for events that will never come."""
        log.critical("run_store_conflict", run_id=run_log.run_id, seq=seq,
                     detail="Redis holds another event at this seq than this replica wrote")
        self._stop_writing(run_log)
        message = ("the run store holds a conflicting event for this run; the run was "
                   "stopped so that its record stays consistent")
        try:
            await self._leases.end(run_log.run_id, "STORE_CONFLICT", message,
                                   self._shared.token(run_log.run_id))
        except RedisError as exc:  # its lease lapses and the run ends RUN_LOST instead
            log.warning("redis_store_conflict_not_recorded", run_id=run_log.run_id,
                        error=str(exc))
        cancel = self._shared.cancel_handler
        if cancel is not None:
            cancel(run_log.run_id, message, "STORE_CONFLICT")
