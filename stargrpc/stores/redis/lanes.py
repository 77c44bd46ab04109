"""The lanes of a fleet (:class:`RedisLanes`): every replica's runs share each lane's slots
and queue, in the same order as one process's (:mod:`stargrpc.runs.lanes`: priority, then
turns between principals, then arrival).

Keys of one lane (under ``redis_key_prefix``; on a cluster ``{lane:NAME}`` is the hash tag,
so a lane's keys share one slot and each script runs on them atomically)::

    lane:NAME:slots      zset    run id (or reserve slot "~replica:n") → its slot's lease
                                 expiry (ms, Redis's clock)
    lane:NAME:starts     hash    run id → when it got its slot (ms)
    lane:NAME:queue      zset    "arrival|run id" → (1000 - priority) · 2**40 + turn
    lane:NAME:alive      zset    "arrival|run id" → the waiting replica's lease on it (ms)
    lane:NAME:queued     hash    run id → "arrival|run id" of each waiting run (ListRuns)
    lane:NAME:turns      hash    "v|P" → the virtual time of priority P; "p|P|principal" →
                                 the principal's next turn; "n" → arrivals; "r" → reserve
                                 slots handed out
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

**Reserves.** Taking a slot in Redis is a round trip before the run starts, where a run
without an idempotency key otherwise has none on its call's path. So a run that gets a slot
while nobody waits in the lane also takes up to :data:`RESERVE_MAX` more for its replica
(at most a :data:`RESERVE_SHARE`-th of the slots then free: a lane of a few slots has
no reserves). They are slots like any other in ``lane:NAME:slots`` ("~replica:n"), leased and
renewed, so the lane's capacity stays exact and a dead replica's reserve lapses with its
lease. The replica's next runs in the lane take an unused reserve slot with no round trip
and put it back when they end. While it holds a reserve the replica looks at the lane every
:data:`POLL_SECONDS` (renewing the reserve and adding its runs' durations and starts); when
runs wait in the lane, on any replica, it stops using the reserve, gives the unused slots
back at once (to the head of the queue) and each used one as its run ends, until a run of
its own enters through Redis and finds the queue empty again. A run that queues behind
another replica's unused reserve so waits one look (at most :data:`POLL_SECONDS` and a
round trip), and a run that enters on the reserve's replica within that look starts before
it. A reserve unused for a lease goes back too. Unused reserve slots have no start in
``lane:NAME:starts``, so the estimate counts them as free.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
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
from stargrpc.stores.background import stop_background
from stargrpc.stores.redis.errors import reachable
from stargrpc.stores.redis.scripts import NOW_MS
from stargrpc.stores.redis.shared import Shared

log = structlog.get_logger("stargrpc.stores.redis")

#: How often a replica with runs waiting in a lane asks Redis where they stand.
POLL_SECONDS = 0.05
#: How long a lane's keys outlive its last use.
LANE_TTL_MS = 24 * 3600 * 1000
#: Slots of one lane a replica holds ahead of its runs at most (its reserve).
RESERVE_MAX = 8
#: A reserve is at most this share (1/N) of the lane's slots free when it is taken: a lane
#: of few slots has none, and others' calls seldom find a lane full of unused reserves.
RESERVE_SHARE = 4


@dataclass
class _Reserve:
    """The slots of one lane this replica holds ahead of its runs: a run that enters while
    one is unused takes it with no round trip to Redis, and gives it back to the reserve
    when it ends. They are leased and renewed like any slot, so the lane's capacity stays
    exact and a dead replica's reserve lapses with its lease.

    Attributes:
        held: The reserve slots in Redis, as this replica last learned.
        unused: Those no run of this replica uses now.
        contended: Runs wait in the lane (on any replica): the reserve is not used, and each
            slot goes back to Redis as soon as it is unused, until an entry through Redis
            finds the queue empty again.
        usable_until: ``time.monotonic()`` before which the leases are surely still held
            (half a lease after the last renewal was sent).
        used_at: When a run last took one.
        durations: Durations of runs that ended on one (ms), not yet in Redis.
    """

    held: set[str] = field(default_factory=set)
    unused: list[str] = field(default_factory=list)
    contended: bool = False
    usable_until: float = 0.0
    used_at: float = 0.0
    durations: list[str] = field(default_factory=list)

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
# of its turn. A replica's run that gets a slot may also take up to ``wanted`` slots ahead
# (a reserve), at most a ``share``-th of the slots then free: they are named
# "~replica:n", leased like any slot, and have no start until a run uses them (a reserve
# slot left unused is free as the estimate sees it). ARGV: max_concurrent, lease_ms, ttl_ms,
# run id, principal, priority, max_queued[, wanted, the reserve's name prefix, share].
# Returns {1, {reserve slots}} granted, {-1, waiting, looks} the queue is full, or
# {0, member, position, looks, turn} queued (``turn``: the one this entry took).
ENTER = _COMMON + """
tidy()
fill()
local run, principal, priority = ARGV[4], ARGV[5], tonumber(ARGV[6])
touch()
if redis.call('ZCARD', KEYS[1]) < max_concurrent and redis.call('ZCARD', KEYS[3]) == 0 then
  grant(run)
  local reserve = {}
  local wanted = tonumber(ARGV[8]) or 0
  if wanted > 0 then
    local free = max_concurrent - redis.call('ZCARD', KEYS[1])
    local block = math.min(wanted, math.floor(free / tonumber(ARGV[10])))
    if block > 0 then
      local last = redis.call('HINCRBY', KEYS[5], 'r', block)
      for n = last - block + 1, last do
        reserve[#reserve + 1] = ARGV[9] .. n
        redis.call('ZADD', KEYS[1], now + lease_ms, reserve[#reserve])
      end
    end
  end
  return {1, reserve}
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
return {0, member, redis.call('ZRANK', KEYS[3], member) + 1, looks(), turn}
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
# ttl_ms, run id, member (or ''), duration_ms (or ''), history[, the principal's turn key,
# the turn its entry took]. A run refused right after it entered (LANE_BUSY: its estimate
# came with the entry) gives its turn back, as one process's lanes never take it: when the
# principal's next turn is still the one after it (no entry of theirs came between), it is
# set back — the later of it and the virtual time is then what it was before the entry.
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
if ARGV[8] then
  local turn = tonumber(ARGV[9])
  if tonumber(redis.call('HGET', KEYS[5], ARGV[8])) == turn + 1 then
    redis.call('HSET', KEYS[5], ARGV[8], turn)
  end
end
fill()
touch()
return 1
"""

# A replica's look at its reserve in one lane: renews the lease of every reserve slot it
# holds, notes when a run started on each used one (for the estimates of runs that queue)
# and adds the lane's durations its runs took on them; returns how many runs wait in the
# lane (any: the replica gives its unused reserve slots back and stops using them) and the
# slots it no longer holds (their lease lapsed while Redis stalled). ARGV: max_concurrent,
# lease_ms, ttl_ms, history, n_used, n_unused, then each used slot and ms since its run
# started, each unused slot, then durations (ms, oldest first).
HOLD = _COMMON + """
tidy()
local n_used, n_unused = tonumber(ARGV[5]), tonumber(ARGV[6])
local lost = {}
local at = 7
for i = 1, n_used + n_unused do
  local slot = ARGV[at]
  if redis.call('ZSCORE', KEYS[1], slot) then
    redis.call('ZADD', KEYS[1], now + lease_ms, slot)
    if i <= n_used then
      redis.call('HSET', KEYS[2], slot, now - tonumber(ARGV[at + 1]))
    else
      redis.call('HDEL', KEYS[2], slot)
    end
  else
    lost[#lost + 1] = slot
  end
  at = at + (i <= n_used and 2 or 1)
end
if at <= #ARGV then
  for i = at, #ARGV do redis.call('LPUSH', KEYS[6], ARGV[i]) end
  redis.call('LTRIM', KEYS[6], 0, tonumber(ARGV[4]) - 1)
end
fill()
touch()
return {redis.call('ZCARD', KEYS[3]), lost}
"""

# A replica gives reserve slots back (unused; or used, their runs ended, while runs wait):
# free slots go to the head of the queue. ARGV: max_concurrent, lease_ms, ttl_ms, then slots.
GIVE_BACK = _COMMON + """
tidy()
for i = 4, #ARGV do
  redis.call('ZREM', KEYS[1], ARGV[i])
  redis.call('HDEL', KEYS[2], ARGV[i])
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
    _hold: Any
    _give_back: Any
    _waiting: dict[str, dict[str, LanePlace]]
    _running: dict[str, LanePlace]
    _reserves: dict[str, _Reserve]
    _on_reserve: dict[str, tuple[LanePlace, str]]
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
        self._hold = redis.register_script(HOLD)
        self._give_back = redis.register_script(GIVE_BACK)
        self._waiting = {name: {} for name in self.configs}
        self._running = {}
        self._reserves = {}
        self._on_reserve = {}
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
        reserve = self._reserves.get(ticket.lane)
        if reserve is not None and reserve.unused and not reserve.contended:
            now = time.monotonic()
            if now < reserve.usable_until:
                place = LanePlace(ticket, granted=True, entered=now, started=now)
                self._on_reserve[ticket.run_id] = (place, reserve.unused.pop())
                reserve.used_at = now
                return place
        config = self.configs[ticket.lane]
        releasing = [task for task in self._leaving if task.get_name() == ticket.lane]
        if releasing:
            # A slot this replica is giving back (a run that just ended, its caller's next
            # call coming right after its Result) is free before this run asks for one.
            await asyncio.wait(releasing)
        wanted = RESERVE_MAX - (len(reserve.held) if reserve is not None else 0)
        sent = time.monotonic()
        with reachable("entering the run's lane"):
            reply = await self._shared.scripts.call(
                self._enter, self.keys(ticket.lane),
                [*self._args(ticket.lane), ticket.run_id, ticket.principal, ticket.priority,
                 config.max_queued, wanted, f"~{self._shared.replica}:", RESERVE_SHARE])
        place = LanePlace(ticket)
        if reply[0] == 1:  # nobody waits in the lane now
            self._granted(place)
            if reply[1]:
                self._reserve(ticket.lane, [slot.decode() for slot in reply[1]], sent)
            elif reserve is not None:
                reserve.contended = False
            return place
        if reserve is not None:  # runs wait: the reserve's slots go to them as they free
            reserve.contended = True
        if reply[0] == -1:
            raise lane_full(ticket.lane, config.max_queued,
                            self._estimate(ticket.lane, int(reply[1]) + 1, reply[2]))
        member = reply[1].decode()
        position = int(reply[2])
        estimate = self._estimate(ticket.lane, position, reply[3])
        if ticket.max_wait and estimate > ticket.max_wait:
            await self._give_up(ticket, member, int(reply[4]))
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
        on_reserve = self._on_reserve.pop(ticket.run_id, None)
        if on_reserve is not None:
            self._leave_reserve(place, on_reserve[1], ran=ran)
            return
        self._waiting.get(ticket.lane, {}).pop(ticket.run_id, None)
        self._running.pop(ticket.run_id, None)
        member = self._members.pop(ticket.run_id, "")
        duration = ""
        if place.granted and ran:
            duration = str(int((time.monotonic() - place.started) * 1000))
        self._send_release(ticket.lane, ticket.run_id, member, duration)

    def _leave_reserve(self, place: LanePlace, slot: str, *, ran: bool) -> None:
        """A run that ran on a reserve slot ended: the slot goes back to the reserve, or to
        Redis while runs wait in the lane."""
        lane = place.ticket.lane
        duration = str(int((time.monotonic() - place.started) * 1000)) if ran else ""
        reserve = self._reserves.get(lane)
        if reserve is None or slot not in reserve.held:
            return  # its lease lapsed (Redis stalled): nothing to give back
        if not reserve.contended:
            reserve.unused.append(slot)
            if duration:
                reserve.durations.append(duration)
            return
        reserve.held.discard(slot)
        if not reserve.held:
            del self._reserves[lane]
        self._send_release(lane, slot, "", duration)

    def _send_release(self, lane: str, slot: str, member: str, duration: str) -> None:
        task = asyncio.get_running_loop().create_task(
            self._release(lane, slot, member, duration), name=lane)
        self._leaving.add(task)
        task.add_done_callback(self._leaving.discard)

    def where(self, run_id: str) -> LanePlace | None:
        for waiting in self._waiting.values():
            if run_id in waiting:
                return waiting[run_id]
        on_reserve = self._on_reserve.get(run_id)
        return on_reserve[0] if on_reserve is not None else self._running.get(run_id)

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

    def reserve(self, lane: str) -> frozenset[str]:
        """The slots of ``lane`` this replica holds ahead of its runs (used or not)."""
        reserve = self._reserves.get(lane)
        return frozenset(reserve.held) if reserve is not None else frozenset()

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

    def _reserve(self, lane: str, slots: list[str], sent: float) -> None:
        """Keeps ``slots`` Redis granted ahead as this replica's reserve in ``lane``: the
        lane's queue was empty when they were taken (``sent``: when the script was sent)."""
        reserve = self._reserves.setdefault(lane, _Reserve())
        if not reserve.held:
            # Slots held before are as sure as their last renewal (the next look renews
            # them, or finds them lapsed): only a new reserve is sure from this script on.
            reserve.usable_until = sent + self._shared.lease_ms / 2000
        reserve.held.update(slots)
        reserve.unused.extend(slots)
        reserve.contended = False
        reserve.used_at = time.monotonic()
        self._start()

    async def _give_up(self, ticket: LaneTicket, member: str, turn: int) -> None:
        """Takes back the entry of a run refused as soon as it entered, and its turn."""
        with contextlib.suppress(RequestError), reachable("leaving the lane"):
            await self._shared.scripts.call(self._leave, self.keys(ticket.lane), [
                *self._args(ticket.lane), ticket.run_id, member, "", DURATION_HISTORY,
                f"p|{ticket.priority}|{ticket.principal}", turn])

    async def _release(self, lane: str, slot: str, member: str, duration: str) -> None:
        """Frees ``slot`` (a run id, or a reserve slot) or gives up the queue's ``member``."""
        try:
            with reachable("leaving the lane"):
                await self._shared.scripts.call(self._leave, self.keys(lane), [
                    *self._args(lane), slot, member, duration, DURATION_HISTORY])
        except RequestError as exc:  # its lease frees it
            log.warning("lane_release_failed", slot=slot, lane=lane, error=exc.message)
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
        while any(self._waiting.values()) or self._running or self._reserves:
            try:
                await self._poll_once()
                await self._hold_once()
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

    async def _hold_once(self) -> None:
        """Renews every reserve; gives a lane's unused reserve slots back when runs wait in
        it (on any replica), or when this replica has not used them for a lease."""
        if not self._reserves:
            return
        now = time.monotonic()
        lanes, calls = [], []
        for lane, reserve in self._reserves.items():
            used = [(slot, int((now - place.started) * 1000))
                    for place, slot in self._on_reserve.values() if place.ticket.lane == lane]
            durations, reserve.durations = reserve.durations, []
            lanes.append((lane, reserve, durations))
            calls.append((self.keys(lane), [
                *self._args(lane), DURATION_HISTORY, len(used), len(reserve.unused),
                *(part for pair in used for part in pair), *reserve.unused, *durations]))
        try:
            replies = await self._shared.scripts.call_all(self._hold, calls)
        except BaseException:
            for _, reserve, durations in lanes:  # added with the next look
                reserve.durations[:0] = durations
            raise
        giving: list[tuple[str, list[str]]] = []
        for (lane, reserve, durations), reply in zip(lanes, replies, strict=True):
            if isinstance(reply, Exception):
                log.warning("redis_lanes_hold_failed", lane=lane, error=str(reply))
                reserve.durations[:0] = durations
                continue
            depth, lost = int(reply[0]), {slot.decode() for slot in reply[1]}
            metrics.LANE_QUEUE_DEPTH.labels(lane).set(depth)
            reserve.usable_until = now + self._shared.lease_ms / 2000
            if lost:
                reserve.held -= lost
                reserve.unused = [slot for slot in reserve.unused if slot not in lost]
            if depth:
                reserve.contended = True
            idle = (len(reserve.unused) == len(reserve.held)
                    and now - reserve.used_at > self._shared.lease_ms / 1000)
            if (depth or idle) and reserve.unused:
                unused, reserve.unused = reserve.unused, []
                reserve.held.difference_update(unused)
                giving.append((lane, unused))
            if not reserve.held and self._reserves.get(lane) is reserve:
                del self._reserves[lane]
        if giving:
            await self._shared.scripts.call_all(self._give_back, [
                (self.keys(lane), [*self._args(lane), *slots]) for lane, slots in giving])

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
        await stop_background(task, "lanes")
        reserves, self._reserves = self._reserves, {}
        giving = [(lane, reserve.unused) for lane, reserve in reserves.items() if reserve.unused]
        if giving:  # best effort: what is not given back lapses with its lease
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self._shared.timeout):
                    await self._shared.scripts.call_all(self._give_back, [
                        (self.keys(lane), [*self._args(lane), *slots])
                        for lane, slots in giving])
        if self._leaving:
            await asyncio.gather(*self._leaving, return_exceptions=True)
