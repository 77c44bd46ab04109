"""The lanes of a fleet (:class:`RedisLanes`): every replica's runs share each lane's slots
and queue, in the same order as one process's (:mod:`stargrpc.runs.lanes`: priority, then
turns between principals, then arrival).

Keys of one lane (under ``redis_key_prefix``; on a cluster ``{lane:NAME}`` is the hash tag,
so a lane's keys share one slot and each script runs on them atomically)::

    lane:NAME:slots      zset    run id → its slot's lease expiry (ms, Redis's clock)
    lane:NAME:starts     hash    run id → when it got its slot (ms)
    lane:NAME:queue      zset    "arrival|run id" → (1000 - priority) · 2**40 + turn
    lane:NAME:alive      zset    "arrival|run id" → the waiting replica's lease on it (ms)
    lane:NAME:queued     hash    run id → "arrival|run id" of each waiting run (ListRuns)
    lane:NAME:turns      hash    "v|P" → the virtual time of priority P; "p|P|principal" →
                                 the principal's next turn; "n" → arrivals
    lane:NAME:durations  list    the lane's last run durations (ms), newest first

Runs take their slots and places in **leases**: the replica holding a slot or a queued run
renews it with every poll (a waiting lane is polled every :data:`POLL_SECONDS`, a running
run's slot about three times a lease), and every script first drops what has lapsed. A
replica that dies so frees its slots within a lease, and its queued runs leave the queue:
they were runs of that replica, whose logs end ``RUN_LOST`` as any of its runs
(:mod:`stargrpc.stores.redis`); a retry with the same idempotency key queues again.

Slots are handed out by whichever script sees them free — entering, polling, releasing —
to the head of the queue, whatever replica waits for it: the waiting replica learns at
its next poll (or at once, when the slot was freed on it).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from typing import Any

import structlog
from redis.exceptions import RedisError

from stargrpc import metrics
from stargrpc.errors import RequestError
from stargrpc.runs.lanes import (
    DURATION_HISTORY,
    LanePlace,
    LaneTicket,
    estimate_wait,
    lane_busy,
    lane_full,
)
from stargrpc.settings import LaneConfig
from stargrpc.stores.redis.errors import reachable
from stargrpc.stores.redis.scripts import NOW_MS
from stargrpc.stores.redis.shared import Shared

log = structlog.get_logger("stargrpc.stores.redis")

#: How often a replica with runs waiting in a lane asks Redis where they stand.
POLL_SECONDS = 0.05
#: How long a lane's keys outlive its last use.
LANE_TTL_MS = 24 * 3600 * 1000

# KEYS = slots, starts, queue, alive, turns, durations, queued. Every script first drops lapsed
# slots and lapsed queued runs, and hands free slots to the head of the queue (fill):
# ARGV[1] = max_concurrent, ARGV[2] = lease_ms.
_COMMON = NOW_MS + """
local now = now_ms()
local max_concurrent = tonumber(ARGV[1])
local lease_ms = tonumber(ARGV[2])
local TURN = 1099511627776  -- 2**40
local function tidy()
  local lapsed = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
  for _, run in ipairs(lapsed) do redis.call('HDEL', KEYS[2], run) end
  if #lapsed > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now) end
  local gone = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now)
  for _, member in ipairs(gone) do
    redis.call('ZREM', KEYS[3], member)
    redis.call('ZREM', KEYS[4], member)
    redis.call('HDEL', KEYS[7], string.match(member, '|(.*)$'))
  end
end
local function grant(run)
  redis.call('ZADD', KEYS[1], now + lease_ms, run)
  redis.call('HSET', KEYS[2], run, now)
end
local function fill()
  local free = max_concurrent - redis.call('ZCARD', KEYS[1])
  while free > 0 do
    local head = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
    if #head == 0 then break end
    local member, score = head[1], tonumber(head[2])
    redis.call('ZREM', KEYS[3], member)
    redis.call('ZREM', KEYS[4], member)
    local priority = 1000 - math.floor(score / TURN)
    local turn = score - (1000 - priority) * TURN
    local virtual = 'v|' .. priority
    if turn > (tonumber(redis.call('HGET', KEYS[5], virtual)) or 0) then
      redis.call('HSET', KEYS[5], virtual, turn)
    end
    local run = string.match(member, '|(.*)$')
    redis.call('HDEL', KEYS[7], run)
    grant(run)
    free = free - 1
  end
end
local function touch()
  for i = 1, 7 do redis.call('PEXPIRE', KEYS[i], ARGV[3]) end
end
-- What an estimate needs: now, the last durations, when each running run started; and
-- how many wait (the depth metric).
local function looks()
  return {now, redis.call('LRANGE', KEYS[6], 0, -1), redis.call('HVALS', KEYS[2]),
          redis.call('ZCARD', KEYS[3])}
end
"""

# A run enters its lane: a slot when one is free and nobody waits, else a place at the end
# of its turn. ARGV: max_concurrent, lease_ms, ttl_ms, run id, principal, priority,
# max_queued. Returns {1} granted, {-1, waiting, looks} the queue is full, or
# {0, member, position, looks} queued.
ENTER = _COMMON + """
tidy()
fill()
local run, principal, priority = ARGV[4], ARGV[5], tonumber(ARGV[6])
touch()
if redis.call('ZCARD', KEYS[1]) < max_concurrent and redis.call('ZCARD', KEYS[3]) == 0 then
  grant(run)
  return {1}
end
local waiting = redis.call('ZCARD', KEYS[3])
if waiting >= tonumber(ARGV[7]) then return {-1, waiting, looks()} end
local mine = 'p|' .. priority .. '|' .. principal
local turn = math.max(tonumber(redis.call('HGET', KEYS[5], 'v|' .. priority)) or 0,
                      tonumber(redis.call('HGET', KEYS[5], mine)) or 0)
redis.call('HSET', KEYS[5], mine, turn + 1)
local member = string.format('%015d|%s', redis.call('HINCRBY', KEYS[5], 'n', 1), run)
local score = (1000 - priority) * TURN + turn
redis.call('ZADD', KEYS[3], score, member)
redis.call('ZADD', KEYS[4], now + lease_ms, member)
redis.call('HSET', KEYS[7], run, member)
return {0, member, redis.call('ZRANK', KEYS[3], member) + 1, looks()}
"""

# A replica's look at its waiting runs of one lane: renews their places, hands out free
# slots, and tells each: ARGV: max_concurrent, lease_ms, ttl_ms, then each run's member.
# Returns {looks, then per member: 0 granted, -1 gone (its place lapsed), or its position}.
POLL = _COMMON + """
tidy()
for i = 4, #ARGV do redis.call('ZADD', KEYS[4], 'XX', now + lease_ms, ARGV[i]) end
fill()
touch()
local answer = {looks()}
for i = 4, #ARGV do
  local rank = redis.call('ZRANK', KEYS[3], ARGV[i])
  if rank then
    answer[#answer + 1] = rank + 1
  elseif redis.call('ZSCORE', KEYS[1], string.match(ARGV[i], '|(.*)$')) then
    answer[#answer + 1] = 0
  else
    answer[#answer + 1] = -1
  end
end
return answer
"""

# Renews the slots of a replica's running runs. Only slots still held: one given back
# meanwhile (its run ended as this renewal was on its way) must not come back, and one that
# lapsed while Redis stalled may have gone to another run already (the run keeps running
# without it). ARGV: max_concurrent, lease_ms, ttl_ms, then run ids.
RENEW = _COMMON + """
for i = 4, #ARGV do redis.call('ZADD', KEYS[1], 'XX', now + lease_ms, ARGV[i]) end
touch()
return 1
"""

# A run leaves its lane: its slot freed (its duration noted when it ran) or its place in the
# queue given up; free slots go to the head of the queue. ARGV: max_concurrent, lease_ms,
# ttl_ms, run id, member (or ''), duration_ms (or ''), history.
LEAVE = _COMMON + """
tidy()
if redis.call('ZREM', KEYS[1], ARGV[4]) == 1 then
  redis.call('HDEL', KEYS[2], ARGV[4])
  if ARGV[6] ~= '' then
    redis.call('LPUSH', KEYS[6], ARGV[6])
    redis.call('LTRIM', KEYS[6], 0, tonumber(ARGV[7]) - 1)
  end
end
if ARGV[5] ~= '' then
  redis.call('ZREM', KEYS[3], ARGV[5])
  redis.call('ZREM', KEYS[4], ARGV[5])
  redis.call('HDEL', KEYS[7], ARGV[4])
end
fill()
touch()
return 1
"""

# Where runs wait, whatever replica admitted them (ListRuns). ARGV: run ids. Returns per run
# {position, priority}, or {0, 0} when it does not wait in this lane.
WHERE = """
local answer = {}
for i = 1, #ARGV do
  local member = redis.call('HGET', KEYS[7], ARGV[i])
  local rank = member and redis.call('ZRANK', KEYS[3], member)
  if rank then
    local score = tonumber(redis.call('ZSCORE', KEYS[3], member))
    answer[i] = {rank + 1, 1000 - math.floor(score / 1099511627776)}
  else
    answer[i] = {0, 0}
  end
end
return answer
"""


class RedisLanes:
    """The fleet's lanes, as one replica takes part in them (a
    :class:`~stargrpc.runs.lanes.LaneBoard`).

    Attributes:
        configs: Each limited lane's limits, by name.
    """

    configs: dict[str, LaneConfig]
    _shared: Shared
    _enter: Any
    _poll: Any
    _renew: Any
    _leave: Any
    _where: Any
    _waiting: dict[str, dict[str, LanePlace]]
    _running: dict[str, LanePlace]
    _members: dict[str, str]
    _task: asyncio.Task[None] | None
    _nudge: asyncio.Event | None
    _leaving: set[asyncio.Task[None]]

    def __init__(self, shared: Shared, configs: Mapping[str, LaneConfig]) -> None:
        self.configs = dict(configs)
        self._shared = shared
        redis = shared.redis
        self._enter = redis.register_script(ENTER)
        self._poll = redis.register_script(POLL)
        self._renew = redis.register_script(RENEW)
        self._leave = redis.register_script(LEAVE)
        self._where = redis.register_script(WHERE)
        self._waiting = {name: {} for name in self.configs}
        self._running = {}
        self._members = {}
        self._task = None
        self._nudge = None
        self._leaving = set()

    def keys(self, lane: str) -> list[str]:
        """The keys of ``lane`` as the scripts take them."""
        shared = self._shared
        name = f"{{lane:{lane}}}" if shared.cluster else f"lane:{lane}"
        return [f"{shared.prefix}{name}:{part}" for part in
                ("slots", "starts", "queue", "alive", "turns", "durations", "queued")]

    def _args(self, lane: str) -> list[Any]:
        return [self.configs[lane].max_concurrent, self._shared.lease_ms, LANE_TTL_MS]

    # -- LaneBoard ---------------------------------------------------------------------------

    async def enter(self, ticket: LaneTicket) -> LanePlace:
        config = self.configs[ticket.lane]
        releasing = [task for task in self._leaving if task.get_name() == ticket.lane]
        if releasing:
            # A slot this replica is giving back (a run that just ended, its caller's next
            # call coming right after its Result) is free before this run asks for one.
            await asyncio.wait(releasing)
        with reachable("entering the run's lane"):
            reply = await self._shared.scripts.call(
                self._enter, self.keys(ticket.lane),
                [*self._args(ticket.lane), ticket.run_id, ticket.principal, ticket.priority,
                 config.max_queued])
        place = LanePlace(ticket)
        if reply[0] == 1:
            self._granted(place)
            return place
        if reply[0] == -1:
            raise lane_full(ticket.lane, config.max_queued,
                            self._estimate(ticket.lane, int(reply[1]) + 1, reply[2]))
        member = reply[1].decode()
        position = int(reply[2])
        estimate = self._estimate(ticket.lane, position, reply[3])
        if ticket.max_wait and estimate > ticket.max_wait:
            await self._give_up(ticket, member)
            raise lane_busy(ticket.lane, estimate, ticket.max_wait)
        place.position, place.estimate = position, estimate
        self._members[ticket.run_id] = member
        self._waiting[ticket.lane][ticket.run_id] = place
        self._start()
        return place

    async def wait(self, place: LanePlace) -> None:
        await place.changed.wait()
        place.changed.clear()

    def leave(self, place: LanePlace, *, ran: bool) -> None:
        if place.released:
            return
        place.released = True
        ticket = place.ticket
        self._waiting.get(ticket.lane, {}).pop(ticket.run_id, None)
        self._running.pop(ticket.run_id, None)
        member = self._members.pop(ticket.run_id, "")
        duration = ""
        if place.granted and ran:
            duration = str(int((time.monotonic() - place.started) * 1000))
        task = asyncio.get_running_loop().create_task(self._release(ticket, member, duration),
                                                      name=ticket.lane)
        self._leaving.add(task)
        task.add_done_callback(self._leaving.discard)

    def where(self, run_id: str) -> LanePlace | None:
        for waiting in self._waiting.values():
            if run_id in waiting:
                return waiting[run_id]
        return self._running.get(run_id)

    async def waiting(self, run_ids: list[str]) -> dict[str, tuple[str, int, int]]:
        """Which of ``run_ids`` wait in a lane, on any replica: run id → (lane, priority,
        position). One script per lane, in one round trip.

        Raises:
            RequestError: Redis could not be reached (UNAVAILABLE).
        """
        if not run_ids or not self.configs:
            return {}
        lanes = list(self.configs)
        with reachable("looking up queued runs"):
            replies = await self._shared.scripts.call_all(
                self._where, [(self.keys(lane), list(run_ids)) for lane in lanes])
        found: dict[str, tuple[str, int, int]] = {}
        for lane, reply in zip(lanes, replies, strict=True):
            if isinstance(reply, Exception):
                raise reply
            for run_id, (position, priority) in zip(run_ids, reply, strict=True):
                if int(position):
                    found[run_id] = (lane, int(priority), int(position))
        return found

    # -- what the scripts answer ------------------------------------------------------------

    def _estimate(self, lane: str, position: int, looks: list[Any]) -> float:
        now_ms, durations, starts = int(looks[0]), looks[1], looks[2]
        return estimate_wait(position, self.configs[lane].max_concurrent,
                             (int(ms) / 1000 for ms in durations),
                             ((now_ms - int(ms)) / 1000 for ms in starts))

    def _granted(self, place: LanePlace) -> None:
        place.granted = True
        place.started = time.monotonic()
        place.position = 0
        self._running[place.ticket.run_id] = place
        self._members.pop(place.ticket.run_id, None)
        place.changed.set()
        self._start()

    async def _give_up(self, ticket: LaneTicket, member: str) -> None:
        with contextlib.suppress(RequestError), reachable("leaving the lane"):
            await self._shared.scripts.call(self._leave, self.keys(ticket.lane), [
                *self._args(ticket.lane), ticket.run_id, member, "", DURATION_HISTORY])

    async def _release(self, ticket: LaneTicket, member: str, duration: str) -> None:
        try:
            with reachable("leaving the lane"):
                await self._shared.scripts.call(self._leave, self.keys(ticket.lane), [
                    *self._args(ticket.lane), ticket.run_id, member, duration,
                    DURATION_HISTORY])
        except RequestError as exc:  # its lease frees it
            log.warning("lane_release_failed", run_id=ticket.run_id, lane=ticket.lane,
                        error=exc.message)
        if self._nudge is not None:
            self._nudge.set()  # a slot freed here may be a waiting run's here

    # -- the background look ------------------------------------------------------------------

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._nudge = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop(),
                                                                name="redis-lanes")

    async def _loop(self) -> None:
        renew_every = max(POLL_SECONDS, self._shared.lease_ms / 3000)
        renewed = time.monotonic()
        while any(self._waiting.values()) or self._running:
            try:
                await self._poll_once()
                if time.monotonic() - renewed >= renew_every:
                    renewed = time.monotonic()
                    await self._renew_once()
            except RedisError as exc:
                log.warning("redis_lanes_poll_failed", error=str(exc))
            except Exception:  # one bad look must not end the looking
                log.exception("redis_lanes_poll_error")
            assert self._nudge is not None
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(POLL_SECONDS):
                    await self._nudge.wait()
            self._nudge.clear()

    async def _poll_once(self) -> None:
        lanes = [(lane, list(waiting.values())) for lane, waiting in self._waiting.items()
                 if waiting]
        if not lanes:
            return
        scripts = self._shared.scripts
        replies = await scripts.call_all(self._poll, [
            (self.keys(lane), [*self._args(lane),
                               *(self._members[p.ticket.run_id] for p in places)])
            for lane, places in lanes])
        for (lane, places), reply in zip(lanes, replies, strict=True):
            if isinstance(reply, Exception):
                log.warning("redis_lanes_poll_failed", lane=lane, error=str(reply))
                continue
            looks, answers = reply[0], reply[1:]
            metrics.LANE_QUEUE_DEPTH.labels(lane).set(int(looks[3]))
            for place, answer in zip(places, answers, strict=True):
                if place.released:
                    continue
                answer = int(answer)
                if answer == 0:
                    self._waiting[lane].pop(place.ticket.run_id, None)
                    self._granted(place)
                elif answer == -1:  # its place lapsed (Redis stalled): it enters again
                    await self._reenter(place)
                elif answer != place.position:
                    place.position = answer
                    if place.worth_telling():
                        place.estimate = self._estimate(lane, answer, looks)
                        place.changed.set()

    async def _reenter(self, place: LanePlace) -> None:
        ticket = place.ticket
        reply = await self._shared.scripts.call(
            self._enter, self.keys(ticket.lane),
            [*self._args(ticket.lane), ticket.run_id, ticket.principal, ticket.priority,
             2**31])  # it was admitted already: a full queue does not refuse it now
        if reply[0] == 1:
            self._waiting[ticket.lane].pop(ticket.run_id, None)
            self._granted(place)
        else:
            self._members[ticket.run_id] = reply[1].decode()

    async def _renew_once(self) -> None:
        by_lane: dict[str, list[str]] = {}
        for run_id, place in self._running.items():
            by_lane.setdefault(place.ticket.lane, []).append(run_id)
        if by_lane:
            await self._shared.scripts.call_all(self._renew, [
                (self.keys(lane), [*self._args(lane), *run_ids])
                for lane, run_ids in by_lane.items()])

    async def aclose(self) -> None:
        """Stops looking (the leases of what this replica held then lapse)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self._leaving:
            await asyncio.gather(*self._leaving, return_exceptions=True)
