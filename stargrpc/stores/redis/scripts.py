"""The store's Lua scripts, each with its written contract, and how calls to them travel.

A script is composed of the building blocks it needs (:data:`NOW_MS`, :data:`REGISTER`,
:data:`LEASED`, :data:`KEEP_CLAIM`, :data:`TAKE`), each written once. :class:`Scripts`
registers them on the store's client and runs them: one call, or many in one round trip
(the client's pipeline, a cluster's pipeline per node, or the flusher's own connection),
loading a script again when Redis lost it, and waiting for replicas (WAIT) on a durable
write.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterPipeline, RedisCluster
from redis.commands.core import AsyncScript
from redis.exceptions import (
    AskError,
    MovedError,
    NoScriptError,
    RedisClusterException,
    ResponseError,
)

from stargrpc.stores.redis.connection import FlushConnection
from stargrpc.stores.redis.errors import as_redis_error, check_acknowledged

# Redis's clock, in ms since the epoch. Prepended to the scripts that read it.
NOW_MS = """
local function now_ms()
  local now = redis.call('TIME')
  return tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
end
"""

# Registers a run of this replica: its lease and its meta hash (state running). Prepended to
# the scripts that register; they take KEYS[1] = lease and KEYS[3] = meta.
REGISTER = """
local function register(token, lease_ms, ttl_ms, owner, tool, replica)
  redis.call('SET', KEYS[1], token, 'PX', lease_ms)
  redis.call('HSET', KEYS[3], 'owner', owner, 'tool', tool, 'replica', replica,
             'state', 'running')
  redis.call('PEXPIRE', KEYS[3], ttl_ms)
end
"""

# Takes the lease back when it lapsed while nobody declared the run lost: a lease runs out
# while its replica is alive whenever Redis stalls (every TTL ends at once when it resumes).
# The replica id in the meta hash says whose run it is. Prepended to the scripts that renew.
LEASED = """
local function leased(token, lease_ms, replica)
  local held = redis.call('GET', KEYS[1])
  if held == token then return true end
  if held or redis.call('HGET', KEYS[3], 'state') ~= 'running'
      or redis.call('HGET', KEYS[3], 'replica') ~= replica then
    return false
  end
  redis.call('SET', KEYS[1], token, 'PX', lease_ms)
  redis.call('HDEL', KEYS[3], 'lapsed')
  return true
end
"""

# Keeps the claim of a running run for as long again; writes it back when it is gone (a
# failover lost it: the replica had not received it yet), so that a retry with its key keeps
# finding the run. A claim holding another run's value is left alone (it was taken over).
KEEP_CLAIM = """
local function keep_claim(key, value, ttl_ms)
  if redis.call('PEXPIRE', key, ttl_ms) == 0 then
    redis.call('SET', key, value, 'PX', ttl_ms, 'NX')
  end
end
"""

# The claim's building blocks: whether Redis's clock is past a deadline ({-2, now_ms} when it
# is), and taking a claim key when it is free, holds the expected value, or is already ours.
TAKE = NOW_MS + """
local function too_late(deadline_ms)
  local now = now_ms()
  if now > tonumber(deadline_ms) then return {-2, now} end
  return false
end
local function take(key, expected, mine, ttl_ms)
  local held = redis.call('GET', key)
  if held ~= mine then
    if expected == '' then
      if held then return {0, held} end
    elseif held ~= expected then
      return {0, held}
    end
  end
  redis.call('SET', key, mine, 'PX', ttl_ms)
  return {1}
end
"""

# The claim of a running run on a cluster, where it lives in another slot than the run.
# KEYS: claim · ARGV: value, running_ttl_ms
RENEW_CLAIM = KEEP_CLAIM + """
keep_claim(KEYS[1], ARGV[1], ARGV[2])
return 1
"""

# Append a batch of events, if this replica still holds the run's lease — or register the run
# first (its first batch: it has no lease yet). Idempotent per seq: a batch is resent when its
# round trip timed out, and Redis may have applied it all the same; an event already stored
# at its seq with the same bytes counts as written, other bytes there are a conflict.
# A batch whose first seq lies past the stream's top finds events missing before it: the
# primary that had acknowledged them failed over to a replica that had not received them yet
# (asynchronous replication); the replica running the run still holds them and writes them
# again, in order, before this batch.
# KEYS: lease, events, meta[, claim (one Redis only)] · ARGV: token, lease_ms, maxlen, finished,
# retention_ms, running_ttl_ms, register ("1" or "0"), owner, tool, replica, the run's
# summary JSON (ListRuns), the seq of the first event, then the bytes of each event
# (consecutive seqs; entry id "{seq}-0").
# Returns {1} written, {-1} the lease is another's or the run was declared lost, {-3, seq}
# another event is stored at seq, {-4, top} events after top are missing before this batch.
APPEND = REGISTER + LEASED + """
local top = 0
local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
if #last > 0 then top = tonumber(string.match(last[1][1], '^%d+')) end
local seq = tonumber(ARGV[12])
local i = 13
local conflict = nil
while i <= #ARGV and seq <= top do
  local stored = redis.call('XRANGE', KEYS[2], seq .. '-0', seq .. '-0')
  -- absent below the top: written, then trimmed (run_max_events)
  if #stored > 0 and stored[1][2][2] ~= ARGV[i] then conflict = seq break end
  i = i + 1
  seq = seq + 1
end
if i > #ARGV and not conflict then return {1} end
if not conflict and seq > top + 1 then return {-4, top} end
if ARGV[7] == '1' and redis.call('EXISTS', KEYS[3]) == 0 then
  register(ARGV[1], ARGV[2], ARGV[6], ARGV[8], ARGV[9], ARGV[10])
elseif not leased(ARGV[1], ARGV[2], ARGV[10]) then
  return {-1}
end
if conflict then return {-3, conflict} end
for j = i, #ARGV do
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], seq .. '-0', 'e', ARGV[j])
  seq = seq + 1
end
redis.call('HSET', KEYS[3], 'summary', ARGV[11])
if ARGV[4] == '1' then
  redis.call('HSET', KEYS[3], 'state', 'finished')
  redis.call('DEL', KEYS[1])
  redis.call('PEXPIRE', KEYS[2], ARGV[5])
  redis.call('PEXPIRE', KEYS[3], ARGV[5])
  if KEYS[4] then redis.call('PEXPIRE', KEYS[4], ARGV[5]) end
else
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  redis.call('PEXPIRE', KEYS[2], ARGV[6])
  redis.call('PEXPIRE', KEYS[3], ARGV[6])
end
return {1}
"""

# Renew the lease of a running run (taking it back if it lapsed); report a pending cancel
# and hand over the steering messages other replicas left for it.
# KEYS: lease, events, meta[, cancel, steer[, claim (one Redis only)]] · ARGV: token,
# lease_ms, running_ttl_ms, replica, the claim's value · Returns {-1} (lease lost) or
# {1 cancel | 0, reason, steers...}.
# On a cluster the script takes the first three keys only, which a running run has: a
# script naming a key that does not exist (cancel and steer mostly do not) is refused with
# TRYAGAIN for as long as its slot is being moved. The cancel and steer keys are read there
# by single-key commands after the lease is renewed (see Leases.renew_once).
RENEW = LEASED + KEEP_CLAIM + """
if not leased(ARGV[1], ARGV[2], ARGV[4]) then return {-1} end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
redis.call('PEXPIRE', KEYS[3], ARGV[3])
if KEYS[6] then keep_claim(KEYS[6], ARGV[5], ARGV[3]) end
local reply = {0, ''}
if KEYS[4] then
  local reason = redis.call('GET', KEYS[4])
  if reason then reply = {1, reason} end
  local steers = redis.call('LRANGE', KEYS[5], 0, -1)
  if #steers > 0 then redis.call('DEL', KEYS[5]) end
  for i = 1, #steers do reply[#reply + 1] = steers[i] end
end
return reply
"""

# Leave a steering message for the replica running a run, within the bound of unread ones.
# KEYS: meta, steer · ARGV: max pending, message JSON, ttl_ms · Returns -1 when the run is
# not running, 0 when the bound is reached, 1 when left.
STEER = """
if redis.call('HGET', KEYS[1], 'state') ~= 'running' then return -1 end
if redis.call('LLEN', KEYS[2]) >= tonumber(ARGV[1]) then return 0 end
redis.call('RPUSH', KEYS[2], ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return 1
"""

# End a run with a terminal Result, once: a run whose replica died (token "": its lease lapsed
# and stayed lapsed for grace_ms by Redis's clock, so a replica that is alive, only cut off by
# a stalled Redis, takes its lease back first), or a run of this replica that cannot go on
# (token = its lease).
# KEYS: lease, events, meta · ARGV: expected last entry id, new entry id, bytes, retention_ms,
# token, grace_ms, state to set · Returns 1 ended, 0 not to be ended (yet), -2 an event
# landed in between (look again).
END = NOW_MS + """
if ARGV[5] == '' then
  if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
  if redis.call('HGET', KEYS[3], 'state') ~= 'running' then return 0 end
  local now = now_ms()
  local lapsed = redis.call('HGET', KEYS[3], 'lapsed')
  if not lapsed then
    redis.call('HSET', KEYS[3], 'lapsed', now)
    return 0
  end
  if now - tonumber(lapsed) < tonumber(ARGV[6]) then return 0 end
elseif redis.call('GET', KEYS[1]) ~= ARGV[5] then
  return 0
end
local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
local last_id = '0-0'
if #last > 0 then last_id = last[1][1] end
if last_id ~= ARGV[1] then return -2 end
redis.call('XADD', KEYS[2], ARGV[2], 'e', ARGV[3])
redis.call('HSET', KEYS[3], 'state', ARGV[7])
redis.call('HDEL', KEYS[3], 'lapsed')
redis.call('DEL', KEYS[1])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
redis.call('PEXPIRE', KEYS[3], ARGV[4])
return 1
"""

# Claim an idempotency key for a run and register the run, in one step (one Redis): when the
# key is free (expected "") or still names the lost or expired run the caller saw (expected =
# that value), or already names this very run (the same claim applied twice: a retried round
# trip). A claim that reaches Redis after its caller gave up (Redis stalled) does nothing:
# past its deadline (ms since the epoch), it answers {-2}.
# Returns {1} when claimed, {-2, Redis's time in ms} when too late, else {0, the value the key
# holds (nil when none)}.
# KEYS: lease, events, meta, claim · ARGV: token, lease_ms, running_ttl_ms, owner, tool,
# replica, expected, mine, deadline_ms
CLAIM = REGISTER + TAKE + """
local late = too_late(ARGV[9])
if late then return late end
local taken = take(KEYS[4], ARGV[7], ARGV[8], ARGV[3])
if taken[1] == 1 then register(ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]) end
return taken
"""

# On a cluster the claim and its run live in different slots, so no one script can hold both
# (CROSSSLOT). There the run is registered first, then the key claimed, each step safe to
# repeat and void once applied after its caller's deadline. The order is what makes two steps
# safe: a claim only ever names a run already registered, so a replica that finds the claim
# also finds the run (running, with a lease) and attaches to it; it never mistakes the run
# for an expired one and runs the tool beside it. A registered run whose claim is then lost to
# another run is deleted by its caller (discard); one whose caller died in between is named by
# no claim and reached by nobody: the sweep ends it RUN_LOST, as any run of a dead replica.
# REGISTER_RUN — KEYS: lease, events, meta · ARGV: token, lease_ms, running_ttl_ms, owner,
# tool, replica, deadline_ms · Returns {1}, or {-2, Redis's time in ms} when too late.
REGISTER_RUN = REGISTER + TAKE + """
local late = too_late(ARGV[7])
if late then return late end
register(ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6])
return {1}
"""

# CLAIM_KEY — KEYS: claim · ARGV: expected, mine, deadline_ms, running_ttl_ms · Returns as
# CLAIM does.
CLAIM_KEY = TAKE + """
local late = too_late(ARGV[3])
if late then return late end
return take(KEYS[1], ARGV[1], ARGV[2], ARGV[4])
"""

# Undo a claim whose caller gave up (it failed UNAVAILABLE) in case Redis applied it anyway,
# once no copy of it can still land (Redis's clock is past its deadline): free the key, and end
# the run it registered — which never started — with its one event, a RUN_LOST Result, so that
# a retry that attached to it meanwhile is told at once. Returns 0 while too early, else 1.
# KEYS: lease, events, meta[, claim (one Redis only)] · ARGV: mine, deadline_ms, token,
# bytes, retention_ms
ABANDON = NOW_MS + """
if now_ms() <= tonumber(ARGV[2]) then return 0 end
if KEYS[4] and redis.call('GET', KEYS[4]) == ARGV[1] then redis.call('DEL', KEYS[4]) end
if redis.call('GET', KEYS[1]) == ARGV[3] and redis.call('EXISTS', KEYS[2]) == 0 then
  redis.call('XADD', KEYS[2], '1-0', 'e', ARGV[4])
  redis.call('HSET', KEYS[3], 'state', 'lost')
  redis.call('DEL', KEYS[1])
  redis.call('PEXPIRE', KEYS[2], ARGV[5])
  redis.call('PEXPIRE', KEYS[3], ARGV[5])
end
return 1
"""

# The claim half of ABANDON on a cluster. KEYS: claim · ARGV: mine, deadline_ms
ABANDON_CLAIM = NOW_MS + """
if now_ms() <= tonumber(ARGV[2]) then return 0 end
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
"""

# Take the runs of runs:running the sweep is due to look at (their score is Redis's time or
# earlier) and put them out of the other sweepers' way for hold_ms: replicas sweeping at once
# take different runs. A run taken by a sweeper that then fails is due again after hold_ms.
# One key (its own slot on a cluster); the runs' keys are looked at by the caller.
# KEYS: runs:running · ARGV: most runs, hold_ms, ttl_ms · Returns {Redis's time in ms, ids...}.
SWEEP_TAKE = NOW_MS + """
local now = now_ms()
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
local reply = {now}
for i = 1, #due do
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), due[i])
  reply[#reply + 1] = due[i]
end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return reply
"""


class Scripts:
    """The scripts registered on the store's client, and the calls that run them.

    Attributes:
        append, renew, end, claim, abandon, register_run, claim_key, renew_claim,
        abandon_claim, steer, sweep_take: One script each (see its contract above).
    """

    append: AsyncScript
    renew: AsyncScript
    end: AsyncScript
    claim: AsyncScript
    abandon: AsyncScript
    register_run: AsyncScript
    claim_key: AsyncScript
    renew_claim: AsyncScript
    abandon_claim: AsyncScript
    steer: AsyncScript
    sweep_take: AsyncScript
    _redis: Redis | RedisCluster
    _wait: tuple[int, int] | None

    def __init__(self, redis: Redis | RedisCluster, *, wait_replicas: int = 0,
                 wait_timeout_ms: int = 500) -> None:
        self._redis = redis
        # What a durable write waits for: replicas, and how long (ms).
        self._wait = (wait_replicas, wait_timeout_ms) if wait_replicas else None
        self.append = redis.register_script(APPEND)
        self.renew = redis.register_script(RENEW)
        self.end = redis.register_script(END)
        self.claim = redis.register_script(CLAIM)
        self.abandon = redis.register_script(ABANDON)
        self.register_run = redis.register_script(REGISTER_RUN)
        self.claim_key = redis.register_script(CLAIM_KEY)
        self.renew_claim = redis.register_script(RENEW_CLAIM)
        self.abandon_claim = redis.register_script(ABANDON_CLAIM)
        self.steer = redis.register_script(STEER)
        self.sweep_take = redis.register_script(SWEEP_TAKE)

    async def call(self, script: AsyncScript, keys: list[str], args: list[Any], *,
                   before: Sequence[tuple[Any, ...]] = ()) -> Any:
        """Runs ``script`` once (after the commands ``before``, in the same round trip: see
        :meth:`call_all`), waiting for ``wait_replicas`` acknowledgements; its reply.

        Raises:
            RedisError: Redis could not be reached, answered with an error, or (see
                :class:`~stargrpc.stores.redis.errors.NotReplicated`) not enough replicas
                acknowledged the write.
        """
        reply = (await self.call_all(script, [(keys, args)], durable=True, before=before))[0]
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def call_all(self, script: AsyncScript, calls: list[tuple[list[str], list[Any]]],
                       line: FlushConnection | None = None, *, durable: bool = False,
                       before: Sequence[tuple[Any, ...]] = ()) -> list[Any]:
        """Runs ``script`` once per (keys, args) in one pipeline (one round trip), on
        ``line`` when given; each reply, or the error of that call. Loads the script first
        if Redis lost it (it was restarted). A ``durable`` write then waits (WAIT, on the
        same connections) for ``wait_replicas`` replicas to acknowledge it. ``before``:
        commands sent ahead of the calls in the same round trip, best effort (their replies
        are not returned, nor waited for: the caller writes them again later).

        Raises:
            RedisError: Redis could not be reached, or (``NotReplicated``) not enough
                replicas acknowledged a durable write.
        """
        wait = self._wait if durable else None
        with as_redis_error():
            if line is not None:
                replies = await line.call_all(script.sha, calls, wait, before)
            elif (len(calls) == 1 and wait is None and not before
                  and not isinstance(self._redis, RedisCluster)):
                replies = [await self._one(script.sha, *calls[0])]
            else:
                replies = await self._pipelined(script.sha, calls, wait, before)
        missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if missing:
            await self._load(script, [calls[i][0] for i in missing])
            again = await self._pipelined(script.sha, [calls[i] for i in missing], wait)
            for i, reply in zip(missing, again, strict=True):
                replies[i] = reply
        return replies

    async def _load(self, script: AsyncScript, keys_of_calls: list[list[str]]) -> None:
        """Loads ``script`` where Redis lost it (restarted, or a replica promoted): on a
        cluster only on the nodes of the calls that missed it, since a load sent to every
        primary waits for any of them that stalls."""
        redis = self._redis
        if isinstance(redis, RedisCluster):
            nodes = {node.name: node for node in (redis.get_node_from_key(keys[0])
                                                  for keys in keys_of_calls)
                     if node is not None}
            if nodes:
                await redis.execute_command("SCRIPT LOAD", script.script,
                                            target_nodes=list(nodes.values()))
                return
        await redis.script_load(script.script)

    async def _one(self, sha: str, keys: list[str], args: list[Any]) -> Any:
        # As one reply of a pipeline: Redis's answer, or the error Redis answered with.
        try:
            return await self._redis.evalsha(sha, len(keys), *keys, *args)
        except ResponseError as exc:
            return exc

    async def _pipelined(self, sha: str, calls: list[tuple[list[str], list[Any]]],
                         wait: tuple[int, int] | None = None,
                         before: Sequence[tuple[Any, ...]] = ()) -> list[Any]:
        """The calls in one pipeline of the client (on a cluster: one per node, sent
        together) after the commands ``before`` (best effort), then WAIT on each connection
        that carried a call when ``wait`` says."""
        redis = self._redis
        nodes: dict[str, Any] = {}
        async with redis.pipeline(transaction=False) as pipe:
            for command in before:
                pipe.execute_command(*command)
            for keys, args in calls:
                pipe.execute_command("EVALSHA", sha, len(keys), *keys, *args)
                if wait is not None and isinstance(redis, RedisCluster):
                    node = redis.get_node_from_key(keys[0])
                    if node is None:
                        raise RedisClusterException(f"no node serves the slot of {keys[0]}")
                    nodes[node.name] = node
            if wait is not None:
                # WAIT counts the writes of its own connection: a cluster's pipeline sends
                # each node's commands on one connection, a WAIT aimed at the node included.
                for node in nodes.values() or [None]:
                    extra = {"target_nodes": node} if node is not None else {}
                    pipe.execute_command("WAIT", *wait, **extra)
            if isinstance(pipe, ClusterPipeline):
                # redis-py would send each redirected call again one after the other, each
                # retrying TRYAGAIN for up to half a second: one run whose slot is being
                # moved would hold up every run's round trip. Redirected calls are sent
                # again here side by side; a TRYAGAIN is answered as such (the caller writes
                # that run again shortly).
                replies = list(await pipe.execute(raise_on_error=False,
                                                  allow_redirections=False))
            else:
                replies = list(await pipe.execute(raise_on_error=False))
        del replies[:len(before)]
        redirected = [i for i, reply in enumerate(replies[:len(calls)])
                      if isinstance(reply, AskError)]  # MOVED or ASK
        if redirected and wait is not None:
            # The WAITs above count the writes of the nodes the calls were sent to, not of
            # the node a redirected call would be sent to again: a redirected durable write
            # is answered with its redirect (one of SLOT_MOVING: a claim tries again, a
            # flush writes again shortly). A MOVED slot is noted first, so that the call is
            # then sent (with its WAIT) to the node that serves it now.
            for i in redirected:
                if isinstance(replies[i], MovedError) and isinstance(redis, RedisCluster):
                    await redis.nodes_manager.move_slot(replies[i])
        elif redirected:
            again = await asyncio.gather(*(self._one(sha, *calls[i]) for i in redirected),
                                         return_exceptions=True)
            for i, reply in zip(redirected, again, strict=True):
                replies[i] = reply
        if wait is not None:
            check_acknowledged(replies[len(calls):], *wait)
        return replies[:len(calls)]
