"""The run store of a fleet: run logs, owners, idempotency claims and leases in Redis.

Keys (all under ``redis_key_prefix``)::

    run:{id}          hash    owner, tool, replica, state (running | finished | lost)
    run:{id}:events   stream  one entry per event, entry id "{seq}-0", field e = RunEvent bytes
    run:{id}:lease    string  the running replica's token; expires unless renewed
    run:{id}:cancel   string  a CancelRun reason for the replica running the run
    run:{id}:steer    list    SteerRun messages (JSON) for the replica running the run
    runs:all          zset    every run's id, scored by its start (ms since the epoch)
    runs:owner:{hash} zset    the same for the runs of one principal (ListRuns)
    runs:running      zset    the id of every running run, scored by when the sweep looks
                              at it next (its lease's expiry as last seen, ms, Redis's clock)
    idem:{digest}     string  JSON {fp, run} — the idempotency claim of (principal, key)

The meta hash also holds ``summary`` (JSON: last seq, current step, outcome and end, as of
the run's last written batch), which ListRuns shows. The indexes are written apart from the
run's scripts (on a cluster they live in slots of their own), when a run is registered and
when it ends; they expire like the runs (each write pushes their TTL out) and drop the ids
of expired runs when a listing comes across them.

A run is written by exactly one replica, which holds its **lease** and renews it (every
second or so, and with every batch of events). Events are appended to an in-process log
first — the Execute stream on the same replica reads them from memory, so the hot path never
waits for Redis — and written to the stream in order, in batches, by the store's one flusher
task: it waits up to 2 ms for more events (not when a Result is waiting), then writes the
next batch of every run that has one in one pipeline of script calls — one round trip,
one connection, however many runs are going.

A run costs Redis **one** script call when it can: a run without an idempotency key is
registered (lease and meta hash) by the same script call that appends its first batch of
events, after the run has started, so nothing of it is on the call's critical path; other
replicas find it from then on (a couple of milliseconds after its START; one asked about it
sooner waits for that write, going by the time in the run id: see ``_first_write_of``). A
run with a key is registered by the script that wins its claim, before it starts (a replica
that sees the claim must find the run). Either way a call fails within
``redis_timeout_seconds`` with UNAVAILABLE when Redis is down or stalled: a claim needs
Redis, and a run without a key is refused while the store's last attempt to reach Redis
failed (checked with a PING until Redis answers again).

Redis stalls more often than it dies, so every write is safe to repeat: a round trip that
timed out may still be applied when Redis resumes. Appends are idempotent per seq (an event
stored at its seq with the same bytes counts as written; other bytes there fail the run
``STORE_CONFLICT``); a claim carries its run id (finding its own run, it has won) and its
deadline (applied later, it does nothing), and a claim whose call gave up is undone in the
background once Redis's clock is past that deadline.

Watchers on any replica read the stream with blocking XREAD, riding out an outage for as long
as the run could still be going. When a run's lease has expired without a Result (its
replica died), the first replica to see it lapsed for a whole further lease appends a
``Result{ERROR, RUN_LOST}`` so every watcher ends, and a retry with the same idempotency key
takes the claim over and runs the tool again. The grace is for a replica that is alive but
was cut off by a stalled Redis (every TTL runs out at once when Redis resumes): it takes its
lease back at its next write. A replica that finds its run declared lost all the same stops
it with the same Result and writes nothing more (the lease fences it).

Nobody need watch a run for that: every replica **sweeps** ``runs:running`` about every
``run_sweep_interval_seconds`` (jittered, at most a quarter of the lease), taking the runs
that are due — a bounded batch, moved out of the other sweepers' way by the same script
(:data:`_SWEEP_TAKE`) — and looking at each: a live lease puts the run back until it could
lapse, a finished or expired run leaves the set, and a lapsed one goes through the same
once-only end-if-lost as a watcher's (:data:`_END`, with its whole further lease of grace).
A run of a dead replica so ends ``RUN_LOST`` within about two leases of the death (a lease,
the grace, and a sweep interval after each), and a delivery of its Result taken over by
another replica finds it. A sweep that cannot reach Redis is logged and tried again at the
next interval.

Idempotency claims are ``SET NX`` with a TTL (the retention, renewed while the run goes).
Streams are trimmed to ``run_max_events`` and expire ``run_retention_seconds`` after the
Result. Any Redis error becomes :class:`~stargrpc.errors.Unavailable`: the call fails fast
with UNAVAILABLE, and the next call reconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import random
import secrets
import socket
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Sequence
from typing import Any

import structlog
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterPipeline, RedisCluster
from redis.commands.core import AsyncScript
from redis.exceptions import (
    AskError,
    ClusterError,
    MaxConnectionsError,
    MovedError,
    NoScriptError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

try:  # installed with redis[hiredis]; without it redis-py packs commands itself
    import hiredis
except ImportError:  # pragma: no cover - hiredis is a declared dependency
    hiredis = None  # type: ignore[assignment]

from stargrpc import metrics
from stargrpc.errors import Aborted, RequestError, ResourceExhausted, Unavailable, reason_name
from stargrpc.ids import minted_ms
from stargrpc.settings import Settings
from stargrpc.stores.base import (
    CancelHandler,
    Claim,
    RunLog,
    RunPage,
    RunQuery,
    RunSummary,
    SteerHandler,
    run_finished_error,
)
from stargrpc.stores.connect import connect
from stargrpc.stores.keys import KeyLayout
from stargrpc.stores.memory import MemoryRunLog
from stargrpc.v1 import errors_pb2, events_pb2

log = structlog.get_logger("stargrpc.stores.redis")

#: Most run ids an index keeps (oldest dropped first); expired runs leave it sooner.
_INDEX_MAX_RUNS = 100_000
#: ListRuns looks at most this many index entries per page (filters may skip many).
_LIST_SCAN_MAX = 2_000
#: Index entries read per round trip of a listing.
_LIST_CHUNK = 100
#: The RetryInfo delay of a call refused because Redis did not answer.
RETRY_AFTER_SECONDS = 1.0
#: How long a watcher waits before reading again after Redis did not answer.
_OUTAGE_RETRY_SECONDS = 0.2
#: A flush sends at most this many bytes of events in one script call.
_FLUSH_BATCH_BYTES = 4 * 1024 * 1024
#: Most lookups of runs unknown to Redis but minted a moment ago (by their id) that wait for
#: the run's first write at once, per store; further ones are not found at once.
MAX_FRESH_RUN_WAITS = 64
#: Entries a watcher reads per XREAD (file chunks are up to a few hundred KiB each).
_READ_COUNT = 64
#: How long the flusher waits for more events before it writes, unless a Result is waiting:
#: a short call's START, END and Result then go in one script call instead of two or three.
_FLUSH_LINGER = 0.002
#: How long a claim waits before it tries again while its slots are being moved
#: (TRYAGAIN), and the longest the flusher waits to write again meanwhile.
_SLOT_MOVING_RETRY_SECONDS = 0.05
_SLOT_MOVING_FLUSH_DELAY_CAP = 0.2
#: What a Redis Cluster answers while a slot moves (or fails over): TRYAGAIN (a multi-key
#: script whose keys are split between two nodes, or not all there), a MOVED or ASK left
#: over, CLUSTERDOWN, and redis-py's "TTL exhausted" after it retried those for a while.
#: Redis is up; the command is to be sent again shortly.
_SLOT_MOVING = (TryAgainError, AskError, ClusterError)
#: Most runs one sweep for lost runs takes from ``runs:running`` (a fuller set is swept on
#: at once, batch by batch).
_SWEEP_MAX_RUNS = 256
#: The message of the Result of a run whose replica stopped responding.
_LOST_MESSAGE = ("the replica running this run stopped responding; retry with the same "
                 "idempotency key to run it again")

# Registers a run of this replica: its lease and its meta hash (state running). Prepended to
# the scripts that register; they take KEYS[1] = lease and KEYS[3] = meta.
_REGISTER = """
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
_LEASED = """
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
_KEEP_CLAIM = """
local function keep_claim(key, value, ttl_ms)
  if redis.call('PEXPIRE', key, ttl_ms) == 0 then
    redis.call('SET', key, value, 'PX', ttl_ms, 'NX')
  end
end
"""

# The claim of a running run on a cluster, where it lives in another slot than the run.
# KEYS: claim · ARGV: value, running_ttl_ms
_RENEW_CLAIM = _KEEP_CLAIM + """
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
_APPEND = _REGISTER + _LEASED + """
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
# by single-key commands after the lease is renewed (see RedisRunStore._renew_loop).
_RENEW = _LEASED + _KEEP_CLAIM + """
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
_STEER = """
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
_END = """
if ARGV[5] == '' then
  if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
  if redis.call('HGET', KEYS[3], 'state') ~= 'running' then return 0 end
  local now = redis.call('TIME')
  local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
  local lapsed = redis.call('HGET', KEYS[3], 'lapsed')
  if not lapsed then
    redis.call('HSET', KEYS[3], 'lapsed', now_ms)
    return 0
  end
  if now_ms - tonumber(lapsed) < tonumber(ARGV[6]) then return 0 end
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

# The claim's building blocks: whether Redis's clock is past a deadline ({-2, now_ms} when it
# is), and taking a claim key when it is free, holds the expected value, or is already ours.
_TAKE = """
local function too_late(deadline_ms)
  local now = redis.call('TIME')
  local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
  if now_ms > tonumber(deadline_ms) then return {-2, now_ms} end
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

# Claim an idempotency key for a run and register the run, in one step (one Redis): when the
# key is free (expected "") or still names the lost or expired run the caller saw (expected =
# that value), or already names this very run (the same claim applied twice: a retried round
# trip). A claim that reaches Redis after its caller gave up (Redis stalled) does nothing:
# past its deadline (ms since the epoch), it answers {-2}.
# Returns {1} when claimed, {-2, Redis's time in ms} when too late, else {0, the value the key
# holds (nil when none)}.
# KEYS: lease, events, meta, claim · ARGV: token, lease_ms, running_ttl_ms, owner, tool,
# replica, expected, mine, deadline_ms
_CLAIM = _REGISTER + _TAKE + """
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
# no claim, reached by nobody, and expires with its lease and meta hash.
# _REGISTER_RUN — KEYS: lease, events, meta · ARGV: token, lease_ms, running_ttl_ms, owner,
# tool, replica, deadline_ms · Returns {1}, or {-2, Redis's time in ms} when too late.
_REGISTER_RUN = _REGISTER + _TAKE + """
local late = too_late(ARGV[7])
if late then return late end
register(ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6])
return {1}
"""
# _CLAIM_KEY — KEYS: claim · ARGV: expected, mine, deadline_ms, running_ttl_ms · Returns as
# _CLAIM does.
_CLAIM_KEY = _TAKE + """
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
_ABANDON = """
local now = redis.call('TIME')
if tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000) <= tonumber(ARGV[2]) then
  return 0
end
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

# The claim half of _ABANDON on a cluster. KEYS: claim · ARGV: mine, deadline_ms
_ABANDON_CLAIM = """
local now = redis.call('TIME')
if tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000) <= tonumber(ARGV[2]) then
  return 0
end
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
"""

# Take the runs of runs:running the sweep is due to look at (their score is Redis's time or
# earlier) and put them out of the other sweepers' way for hold_ms: replicas sweeping at once
# take different runs. A run taken by a sweeper that then fails is due again after hold_ms.
# One key (its own slot on a cluster); the runs' keys are looked at by the caller.
# KEYS: runs:running · ARGV: most runs, hold_ms, ttl_ms · Returns {Redis's time in ms, ids...}.
_SWEEP_TAKE = """
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now_ms, 'LIMIT', 0, tonumber(ARGV[1]))
local reply = {now_ms}
for i = 1, #due do
  redis.call('ZADD', KEYS[1], now_ms + tonumber(ARGV[2]), due[i])
  reply[#reply + 1] = due[i]
end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return reply
"""


def _check_acknowledged(replies: list[Any], replicas: int, timeout_ms: int) -> None:
    """Raises :class:`NotReplicated` unless every WAIT reply counts ``replicas``."""
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
        if int(reply) < replicas:
            raise NotReplicated(f"{reply} of {replicas} Redis replicas acknowledged the write "
                                f"within {timeout_ms} ms (redis_wait_replicas)")


class NotReplicated(RedisTimeoutError):
    """Redis applied a write, but fewer replicas than ``redis_wait_replicas`` acknowledged
    it in ``redis_wait_timeout_ms``: it counts as failed (and is repeated, or the call fails
    UNAVAILABLE), since a failover could still lose it."""


class _ClaimTooLate(Exception):
    """Redis answered that the call's deadline (by its clock) passed before the claim
    reached it. No OSError, unlike a TimeoutError: no Redis failure, and not reported as
    one by :func:`_as_redis_error`."""


def _log_clock_ahead(ahead_ms: int) -> None:
    log.warning("redis_clock_ahead", ahead_ms=ahead_ms,
                detail="Redis's clock runs ahead of this host's; claims allow for it")


def _log_unavailable(action: str, error: str) -> None:
    log.warning("redis_unavailable", action=action, error=error)


@contextlib.contextmanager
def _as_redis_error() -> Iterator[None]:
    """Reports what redis-py's cluster client raises on a connection torn down under it (a
    node killed mid-command: an AttributeError on the closed writer, an OSError), or when no
    node of the cluster answers (a RedisClusterException, which is no RedisError), as the
    connection error it is; a bare TimeoutError (an OSError too) as the timeout it is.

    Only around redis-py's calls: a deadline of this module's own (``asyncio.timeout``)
    is kept outside, or its TimeoutError would be reported as Redis's."""
    try:
        yield
    except TimeoutError as exc:  # no answer in time: the connection may well be fine
        raise RedisTimeoutError(f"no answer in time ({exc or 'timed out'})") from exc
    except (AttributeError, OSError) as exc:
        raise RedisConnectionError(f"connection lost ({type(exc).__name__}: {exc})") from exc
    except RedisClusterException as exc:  # no node reachable, or no node serving a slot
        raise RedisConnectionError(f"Redis Cluster unreachable ({exc})") from exc


@contextlib.contextmanager
def _reachable(action: str) -> Iterator[None]:
    """Turns a Redis failure into UNAVAILABLE with a message a caller can act on."""
    try:
        with _as_redis_error():
            yield
    except NotReplicated as exc:
        _log_unavailable(action, str(exc))
        raise Unavailable(f"the shared run store (Redis) did not confirm the write on its "
                          f"replicas ({action}: {exc}); retry shortly",
                          reason="RUN_STORE_UNAVAILABLE",
                          retry_after=RETRY_AFTER_SECONDS) from exc
    except (RedisConnectionError, RedisTimeoutError) as exc:
        _log_unavailable(action, str(exc))
        raise Unavailable(f"the shared run store (Redis) is unreachable ({action}); retry "
                          "shortly", reason="RUN_STORE_UNAVAILABLE",
                          retry_after=RETRY_AFTER_SECONDS) from exc
    except _SLOT_MOVING as exc:  # a cluster moving the slot: Redis is up, try again soon
        _log_unavailable(action, f"slot moving: {exc}")
        raise Unavailable(f"the shared run store (Redis Cluster) is moving or failing over "
                          f"this run's slot ({action}); retry shortly",
                          reason="RUN_STORE_UNAVAILABLE",
                          retry_after=RETRY_AFTER_SECONDS) from exc
    except RedisError as exc:  # Redis answered with an error: still not the caller's fault
        log.error("redis_failed", action=action, error=str(exc))
        raise Unavailable(f"the shared run store (Redis) failed ({action}); retry shortly",
                          reason="RUN_STORE_FAILED", retry_after=RETRY_AFTER_SECONDS) from exc


class RedisRunLog(MemoryRunLog):
    """The log of a run executing on this replica: in memory for local readers, flushed to
    the Redis stream in order for everyone else (by the store's flusher)."""

    claim_key: str
    claim_value: str
    registered: bool
    lease_lost: bool
    swept: bool
    deadline: float
    _store: RedisRunStore
    _pending: list[tuple[int, bytes, bool]]
    _flushing: bool

    def __init__(self, store: RedisRunStore, run_id: str, owner: str, tool: str) -> None:
        super().__init__(run_id, owner=owner, tool=tool)
        self._store = store
        self.claim_key = ""
        self.claim_value = ""
        # Whether the run's lease and meta hash are in Redis (by its claim or first flush).
        self.registered = False
        self.lease_lost = False
        # Whether the run was put into runs:running (the sweep for lost runs looks at it).
        self.swept = False
        # When (monotonic) the call starting the run stops waiting for Redis: set on publish.
        self.deadline = 0.0
        self._pending = []
        self._flushing = False

    def append_nowait(self, event: events_pb2.RunEvent) -> events_pb2.RunEvent:
        event = super().append_nowait(event)
        if self._flushing and not self.lease_lost:
            clean = not self._pending
            # The same bytes the run's own streams send (serialised once, kept by the log).
            self._pending.append((event.seq, self.encoded(event.seq), self.finished))
            # A log with events pending is already due a flush (or being flushed, and then
            # handed back for the rest): only its first event, and its Result, which is
            # written at once, need telling the store.
            if clean or self.finished:
                self._store._wants_flush(self)
        return event

    def start_flushing(self) -> None:
        """Copies events to Redis from now on (once the run is published)."""
        self._flushing = True

    def resend_from(self, seq: int) -> None:
        """Queues the events from ``seq`` up to the pending ones again (the store lost them
        in a failover), ahead of what is pending."""
        first = self._pending[0][0] if self._pending else self.last_seq + 1
        self._pending[:0] = [(n, self.encoded(n), False) for n in range(max(1, seq), first)]

    def next_batch(self) -> list[tuple[int, bytes, bool]]:
        """The oldest pending events, up to :data:`_FLUSH_BATCH_BYTES` (at least one)."""
        batch: list[tuple[int, bytes, bool]] = []
        size = 0
        for item in self._pending:
            if batch and size + len(item[1]) > _FLUSH_BATCH_BYTES:
                break
            batch.append(item)
            size += len(item[1])
        return batch


class RemoteRunLog:
    """A run's log as any replica reads it from Redis."""

    run_id: str
    owner: str
    tool: str
    _store: RedisRunStore
    _finished: bool
    _last_seq: int
    _raw: dict[int, bytes]

    def __init__(self, store: RedisRunStore, run_id: str, owner: str, tool: str,
                 finished: bool, last_seq: int) -> None:
        self._store = store
        self.run_id = run_id
        self.owner = owner
        self.tool = tool
        self._finished = finished
        self._last_seq = last_seq
        self._raw = {}

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def last_seq(self) -> int:
        return self._last_seq

    async def append(self, event: events_pb2.RunEvent) -> events_pb2.RunEvent:
        raise RuntimeError(f"run {self.run_id} is written by the replica running it")

    def append_nowait(self, event: events_pb2.RunEvent) -> events_pb2.RunEvent:
        raise RuntimeError(f"run {self.run_id} is written by the replica running it")

    async def follow(self, after_seq: int = 0, *, max_lag: int = 0
                     ) -> AsyncIterator[events_pb2.RunEvent]:
        batches = self.follow_batches(after_seq, max_lag=max_lag)
        async with contextlib.aclosing(batches):
            async for batch in batches:
                for event in batch:
                    yield event

    def encoded(self, seq: int) -> bytes:
        """The bytes of event ``seq`` as Redis gave them, for the events of the latest
        batch (one follower per opened log: :meth:`RedisRunStore.open` makes one each).

        Raises:
            IndexError: That event is not in the latest batch (as :class:`RunLog` says).
        """
        try:
            return self._raw[seq]
        except KeyError:
            raise IndexError(f"no bytes of event {seq} of run {self.run_id}") from None

    async def follow_batches(self, after_seq: int = 0, *, max_lag: int = 0
                             ) -> AsyncGenerator[Sequence[events_pb2.RunEvent], None]:
        """As :meth:`follow`; a batch is what one read from Redis returned."""
        # Reading from Redis holds nothing per watcher, so ``max_lag`` is not needed here;
        # the stream's own trimming is what a slow watcher can fall behind.
        del max_lag
        store = self._store
        key = store._key(self.run_id, "events")
        expected = max(0, after_seq) + 1
        last_id = f"{expected - 1}-0"
        # A stalled Redis is ridden out for as long as the run could still be going (its
        # lease, then as long again before it may be declared lost); a longer outage ends the
        # watch UNAVAILABLE, and the caller resumes after the last seq it saw.
        outage_since: float | None = None
        while True:
            try:
                with _reachable("reading run events"):
                    # The client's reply types are loose; the shape is [[key, [(id, fields)]]].
                    reply: Any = await store.redis.xread({key: last_id}, count=_READ_COUNT,
                                                         block=store.block_ms)
                    if not reply and await self._ended(last_id):
                        return
            except Unavailable as exc:
                now = time.monotonic()
                outage_since = now if outage_since is None else outage_since
                if (exc.reason != "RUN_STORE_UNAVAILABLE"
                        or now - outage_since > 2 * store.lease_ms / 1000):
                    raise
                await asyncio.sleep(_OUTAGE_RETRY_SECONDS)
                continue
            outage_since = None
            if not reply:
                continue
            batch: list[events_pb2.RunEvent] = []
            self._raw = {}
            for entry_id, fields in reply[0][1]:
                seq = int(entry_id.split(b"-", 1)[0])
                if seq != expected:
                    if batch:
                        break  # send what came before the gap first
                    raise Aborted(
                        f"events {expected}..{seq - 1} of run {self.run_id} were trimmed "
                        f"(run_max_events); resume with after_seq={seq - 1} to skip them",
                        reason="EVENTS_TRIMMED",
                        metadata={"run_id": self.run_id, "first_kept_seq": str(seq)})
                data = fields[b"e"]
                event = events_pb2.RunEvent.FromString(data)
                self._raw[event.seq] = data  # as the stream asks for it (by the event's seq)
                batch.append(event)
                expected += 1
                last_id = entry_id.decode()
                if event.HasField("result"):
                    break
            if batch:
                yield batch
                if batch[-1].HasField("result"):
                    return


    async def _ended(self, last_id: str) -> bool:
        # Quiet for a while: make sure the run is still alive somewhere, and stop when it
        # has ended and nothing is left after ``last_id`` (a watcher that asked for events
        # past the Result).
        store = self._store
        await store._end_if_lost(self.run_id)
        return (await store._state(self.run_id) not in ("running", "orphaned")
                and not await store.redis.xrange(store._key(self.run_id, "events"),
                                                 f"({last_id}", count=1))


def _pack(conn: Any, commands: list[tuple[Any, ...]]) -> list[bytes]:
    """The commands in Redis's wire protocol: packed by hiredis in C when it is installed
    (the same bytes, six times faster than redis-py's asyncio connection packs them)."""
    if hiredis is None:
        return list(conn.pack_commands(commands))
    return [hiredis.pack_command(command) for command in commands]


class _FlushConnection:
    """One connection of the flusher's own, driven directly: the script calls of a round
    trip are packed and sent in one write and their replies read back in order.

    redis-py's client takes a pooled connection, a lock and a retry wrapper on every
    command, and enforces its socket timeout with a task per command; the flusher runs on
    every run, one round trip at a time, so it keeps a connection of its own, made like the
    client's but without socket timeout (the flusher bounds each round trip itself). Any
    failure drops the connection (a reply may be half read); the next round trip connects
    afresh.
    """

    def __init__(self, client: Redis) -> None:
        pool = client.connection_pool
        self._conn: Any = pool.connection_class(
            **{**pool.connection_kwargs, "socket_timeout": None})

    async def call_all(self, sha: str, calls: list[tuple[list[str], list[Any]]],
                       wait: tuple[int, int] | None = None) -> list[Any]:
        """Each call's reply, or the error Redis answered it with; with ``wait`` (replicas,
        timeout in ms), WAIT follows the calls on the same connection.

        Raises:
            RedisError: Redis could not be reached (or cut the connection), or
                (:class:`NotReplicated`) not enough replicas acknowledged the calls.
        """
        commands: list[tuple[Any, ...]] = [("EVALSHA", sha, len(keys), *keys, *args)
                                           for keys, args in calls]
        if wait is not None:
            commands.append(("WAIT", *wait))
        replies = await self.commands(commands)
        if wait is not None:
            try:
                _check_acknowledged(replies[len(calls):], *wait)
            except BaseException:
                await self._conn.disconnect(nowait=True)
                raise
        return replies[:len(calls)]

    async def commands(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Each command's reply, or the error Redis answered it with, in one round trip.

        Raises:
            RedisError: Redis could not be reached (or cut the connection).
        """
        conn = self._conn
        try:
            await conn.send_packed_command(_pack(conn, commands), check_health=False)
            replies: list[Any] = []
            for _ in commands:
                try:
                    replies.append(await conn.read_response())
                except ResponseError as exc:  # this call's answer; the others still come
                    replies.append(exc)
            return replies
        except BaseException:
            await conn.disconnect(nowait=True)
            raise

    async def aclose(self) -> None:
        """Closes the connection."""
        await self._conn.disconnect()


class RedisRunStore:
    """Run logs, owners, idempotency claims and leases in Redis, shared by replicas.

    Attributes:
        redis: The client.
        timeout: Longest a call waits for Redis before the run starts (publish and claim
            together); past it the call fails UNAVAILABLE.
        flush_timeout: Longest a flusher round trip may take before it counts as failed.
        prefix: Prefix of every key.
        replica: This replica's id, recorded with the runs it executes.
        keys: The key layout (hash-tagged on a cluster).
        cluster: Whether ``redis`` is a Redis Cluster client (then claims take two steps).
        wait_replicas: Replicas that must acknowledge each claim and batch of events (WAIT).
        cancel_handler: Set by the runtime; stops a run of this process.
        steer_handler: Set by the runtime; steers a run of this process.
        max_pending_steers: Steering messages left for another replica's run at most.
        sweep_interval: Seconds between two sweeps for lost runs (on average three quarters
            of it: jittered), at most a quarter of the lease.
    """

    redis: Redis | RedisCluster
    keys: KeyLayout
    cluster: bool
    wait_replicas: int
    wait_timeout_ms: int
    timeout: float
    flush_timeout: float
    prefix: str
    replica: str
    retention_ms: int
    lease_ms: int
    max_events: int
    block_ms: int
    cancel_handler: CancelHandler | None
    steer_handler: SteerHandler | None
    max_pending_steers: int
    healthy: bool
    _local: dict[str, RedisRunLog]
    _fresh_waits: int
    _abandoned: dict[str, tuple[str, str, int]]
    _clock_ahead_ms: int
    _renewer: asyncio.Task[None] | None
    sweep_interval: float
    _sweeper: asyncio.Task[None] | None
    _dirty: dict[str, RedisRunLog]
    _flush_now: asyncio.Event
    _linger: asyncio.TimerHandle | None
    _flushed: asyncio.Event
    _flusher: asyncio.Task[None] | None
    _slot_moving: bool
    _page_token_key: bytes | None

    def __init__(self, redis: Redis | RedisCluster, *, prefix: str = "stargrpc:",
                 retention: float = 600.0, lease: float = 10.0, max_events: int = 100_000,
                 block_seconds: float = 1.0, flush_timeout: float = 5.0,
                 timeout: float = 2.0, wait_replicas: int = 0,
                 wait_timeout_ms: int = 500, max_pending_steers: int = 16,
                 sweep_interval: float = 1.0) -> None:
        self.redis = redis
        self.cluster = isinstance(redis, RedisCluster)
        self.keys = KeyLayout(prefix, tagged=self.cluster)
        self.wait_replicas = wait_replicas
        self.wait_timeout_ms = wait_timeout_ms
        self.timeout = timeout
        self.flush_timeout = flush_timeout
        # A cluster's writes go to the node of each run's slot: through the client's pipeline.
        self._flush_line = None if isinstance(redis, RedisCluster) else _FlushConnection(redis)
        self.prefix = prefix
        self.replica = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.retention_ms = max(1, int(retention * 1000))
        self.lease_ms = int(lease * 1000)
        self.max_events = max_events
        self.block_ms = max(10, int(block_seconds * 1000))
        self.cancel_handler = None
        self.steer_handler = None
        self.max_pending_steers = max_pending_steers
        # False until Redis has answered, and again after a background write failed: then a
        # new run without a key (which would reach Redis only after it started) is refused
        # unless a PING gets through.
        self.healthy = False
        self._local = {}
        self._fresh_waits = 0
        # Claims whose call gave up, by run id: (claim key, its value, deadline in ms since
        # the epoch). The renewer undoes them once Redis's clock is past the deadline.
        self._abandoned = {}
        # How far Redis's clock runs ahead of this host's, as last seen by a claim.
        self._clock_ahead_ms = 0
        self._renewer = None
        self.sweep_interval = max(0.01, min(sweep_interval, lease / 4))
        self._sweeper = None
        # Runs with events to write. One flusher writes them all, one pipeline of script
        # calls per round trip, so concurrent runs share round trips and a connection.
        self._dirty = {}
        self._flush_now = asyncio.Event()
        self._linger = None
        self._flushed = asyncio.Event()
        self._flusher = None
        # Whether the last flush failed (partly) because a cluster was moving a slot.
        self._slot_moving = False
        self._page_token_key = None  # read from Redis when first needed
        self._append_script = redis.register_script(_APPEND)
        self._renew_script = redis.register_script(_RENEW)
        self._end_script = redis.register_script(_END)
        self._claim_script = redis.register_script(_CLAIM)
        self._abandon_script = redis.register_script(_ABANDON)
        self._register_run_script = redis.register_script(_REGISTER_RUN)
        self._claim_key_script = redis.register_script(_CLAIM_KEY)
        self._renew_claim_script = redis.register_script(_RENEW_CLAIM)
        self._abandon_claim_script = redis.register_script(_ABANDON_CLAIM)
        self._steer_script = redis.register_script(_STEER)
        self._sweep_take_script = redis.register_script(_SWEEP_TAKE)

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
                   sweep_interval=settings.run_sweep_interval_seconds)

    # -- keys ------------------------------------------------------------------------------

    def _key(self, run_id: str, part: str = "") -> str:
        return self.keys.run(run_id, part)

    def _claim_key(self, owner: str, key: str) -> str:
        return self.keys.claim(owner, key)

    @property
    def _running_key(self) -> str:
        """The set of running runs the sweep for lost runs looks at."""
        return f"{self.prefix}runs:running"

    @property
    def _running_ttl_ms(self) -> int:
        return self.retention_ms + self.lease_ms

    # -- RunStore --------------------------------------------------------------------------

    def create(self, run_id: str, owner: str = "", tool: str = "") -> RedisRunLog:
        return RedisRunLog(self, run_id, owner, tool)

    async def open(self, run_id: str) -> RunLog | None:
        local = self._local.get(run_id)
        if local is not None:
            return local
        with _reachable("looking up the run"):
            meta, last = await self._look_up(run_id)
            if not meta and await self._first_write_of(run_id):
                meta, last = await self._look_up(run_id)
        if not meta:
            return None
        last_seq = int(last[0][0].split(b"-", 1)[0]) if last else 0
        return RemoteRunLog(self, run_id, meta.get(b"owner", b"").decode(),
                            meta.get(b"tool", b"").decode(),
                            finished=meta.get(b"state") != b"running", last_seq=last_seq)

    async def _look_up(self, run_id: str) -> tuple[dict[bytes, bytes], list[Any]]:
        """A run's meta hash (empty when Redis has none) and its last event."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(self._key(run_id))
            pipe.xrevrange(self._key(run_id, "events"), count=1)
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
        if minted is None or self._fresh_waits >= MAX_FRESH_RUN_WAITS:
            return False
        self._fresh_waits += 1
        try:
            return await self._first_event_within(run_id, minted)
        finally:
            self._fresh_waits -= 1

    async def _first_event_within(self, run_id: str, minted: int) -> bool:
        window_ms = int((self.timeout + self.flush_timeout + 1.0) * 1000)
        until = time.monotonic() + min(window_ms, minted + window_ms - time.time() * 1000) / 1000
        key = self._key(run_id, "events")
        while (left := until - time.monotonic()) > 0:
            # In slices: a blocking read must end within the client's socket timeout.
            reply = await self.redis.xread({key: "0-0"}, count=1,
                                           block=max(1, min(int(left * 1000), self.block_ms)))
            if reply:
                return True
        return False

    async def publish(self, log: RunLog) -> None:
        # No round trip: the run is registered by its claim or by its first flush.
        assert isinstance(log, RedisRunLog)
        log.deadline = time.monotonic() + self.timeout
        if not self.healthy:
            try:
                # The deadline outside _reachable: running out of it is told as such, not as
                # a timeout of redis-py's (which _reachable reports as Redis unreachable).
                async with asyncio.timeout(self.timeout):
                    with _reachable("registering the run"):
                        await self.redis.ping()
            except TimeoutError as exc:
                _log_unavailable("registering the run", "no answer in time")
                raise Unavailable("the shared run store (Redis) did not answer in time "
                                  "(registering the run); retry shortly",
                                  reason="RUN_STORE_UNAVAILABLE",
                                  retry_after=RETRY_AFTER_SECONDS) from exc
            self.healthy = True
        self._local[log.run_id] = log
        log.start_flushing()
        if self._renewer is None or self._renewer.done():
            self._renewer = asyncio.create_task(self._renew_loop(), name="redis-lease-renewal")

    async def register(self, log: RunLog) -> None:
        # Before the run starts, as a claim registers it: a replica that learns of the run
        # from then on (a delivery to take over) finds it, and ends it RUN_LOST if this
        # replica dies. Void when Redis applies it after the call's deadline (_REGISTER_RUN).
        assert isinstance(log, RedisRunLog)
        if log.registered:
            return  # by its claim
        try:
            async with asyncio.timeout(max(0.0, log.deadline - time.monotonic())):
                with _reachable("registering the run"):
                    while True:
                        try:
                            reply = await self._call(self._register_run_script,
                                                     self._run_keys(log.run_id), [
                                self._token(log.run_id), self.lease_ms,
                                self._running_ttl_ms, log.owner, log.tool, self.replica,
                                self._deadline_ms(log)])
                        except _SLOT_MOVING:
                            await asyncio.sleep(_SLOT_MOVING_RETRY_SECONDS)
                            continue
                        if reply[0] == 1:
                            break
                        ahead = int(reply[1]) - int(time.time() * 1000)
                        if ahead <= self._clock_ahead_ms:
                            raise _ClaimTooLate
                        _log_clock_ahead(ahead)  # not late: Redis's clock runs ahead
                        self._clock_ahead_ms = ahead
        except (TimeoutError, _ClaimTooLate) as exc:
            _log_unavailable("registering the run", "no answer in time")
            raise Unavailable("the shared run store (Redis) did not answer in time "
                              "(registering the run); retry shortly",
                              reason="RUN_STORE_UNAVAILABLE",
                              retry_after=RETRY_AFTER_SECONDS) from exc
        log.registered = True
        await self._index_runs([log])

    async def claim(self, owner: str, key: str, fingerprint: str, log: RunLog) -> Claim:
        assert isinstance(log, RedisRunLog)
        claim_key = self._claim_key(owner, key)
        mine = json.dumps({"fp": fingerprint, "run": log.run_id})
        # Redis's clock decides whether the claim came too late (see _CLAIM); the call gives
        # up at the same moment by this process's clock.
        try:
            # The call's deadline outside _reachable, which reports a timeout of redis-py's
            # as Redis unreachable: this one (or a claim Redis found late) is told as such.
            async with asyncio.timeout(max(0.0, log.deadline - time.monotonic())):
                with _reachable("claiming the idempotency key"):
                    while True:
                        try:
                            return await self._claim(log, claim_key, fingerprint, mine)
                        except _SLOT_MOVING:
                            # The run's slot or the claim's is being moved (TRYAGAIN until
                            # its keys are all on one node): every step of a claim is safe
                            # to repeat, so try again until the call's deadline.
                            await asyncio.sleep(_SLOT_MOVING_RETRY_SECONDS)
        except (Unavailable, TimeoutError, _ClaimTooLate) as exc:
            # Redis may apply the claim after this call gave up (it stalled, or the reply
            # was lost): undo it in the background once it no longer can.
            self._abandoned[log.run_id] = (claim_key, mine, self._deadline_ms(log))
            if isinstance(exc, Unavailable):
                raise
            _log_unavailable("claiming the idempotency key", "the call's deadline passed "
                             "before Redis took the claim" if isinstance(exc, _ClaimTooLate)
                             else "no answer in time")
            raise Unavailable("the shared run store (Redis) did not answer in time (claiming "
                              "the idempotency key); retry shortly",
                              reason="RUN_STORE_UNAVAILABLE",
                              retry_after=RETRY_AFTER_SECONDS) from exc

    def _deadline_ms(self, log: RedisRunLog) -> int:
        """The call's deadline by Redis's clock, in ms since the epoch."""
        remaining = log.deadline - time.monotonic()
        return int((time.time() + remaining) * 1000) + self._clock_ahead_ms

    async def _claim(self, log: RedisRunLog, claim_key: str, fingerprint: str, mine: str
                     ) -> Claim:
        # What the key must hold for this run to take it: nothing, or a lost or expired run.
        expected: bytes | str = ""
        for _ in range(10):
            register = [self._token(log.run_id), self.lease_ms, self._running_ttl_ms,
                        log.owner, log.tool, self.replica]
            reply: Any
            if not self.cluster:  # one script: the claim and its run, atomically
                reply = await self._call(self._claim_script, self._with_claim(
                    self._run_keys(log.run_id), claim_key),
                    [*register, expected, mine, self._deadline_ms(log)])
            elif not log.registered:  # two steps, the run first (see _REGISTER_RUN)
                reply = await self._call(self._register_run_script, self._run_keys(log.run_id),
                                         [*register, self._deadline_ms(log)])
                if reply[0] == 1:
                    log.registered = True
                    continue
            else:
                reply = await self._call(self._claim_key_script, [claim_key], [
                    expected, mine, self._deadline_ms(log), self._running_ttl_ms])
            if reply[0] == 1:  # claimed, and the run registered with it
                log.claim_key = claim_key
                log.claim_value = mine
                log.registered = True
                await self._index_runs([log])
                return Claim(log.run_id, fingerprint, won=True)
            if reply[0] == -2:
                ahead = int(reply[1]) - int(time.time() * 1000)
                if ahead <= self._clock_ahead_ms or time.monotonic() >= log.deadline:
                    raise _ClaimTooLate
                # Not late: Redis's clock is ahead of this host's. Count with it from now on.
                _log_clock_ahead(ahead)
                self._clock_ahead_ms = ahead
                continue
            raw, expected = reply[1], ""
            if raw is None:
                continue  # expired in between; try again
            held = json.loads(raw)
            if held["fp"] != fingerprint:
                return Claim(held["run"], held["fp"], won=False)
            state = await self._state(held["run"])
            if state == "orphaned":
                # Its replica is lost only once its lease has stayed lapsed for a whole
                # lease; until then follow the run, which is either resumed by its replica or
                # ended RUN_LOST (then a retry runs the tool).
                await self._end_if_lost(held["run"])
                state = await self._state(held["run"])
            if state in ("running", "finished", "orphaned"):
                return Claim(held["run"], held["fp"], won=False)
            # Lost, or expired: the key is free for this run, if nobody took it first.
            expected = raw
        raise Unavailable("the idempotency key is contended; retry", reason="CLAIM_CONTENDED",
                          retry_after=RETRY_AFTER_SECONDS)

    async def discard(self, log: RunLog) -> None:
        self._local.pop(log.run_id, None)
        self._dirty.pop(log.run_id, None)
        if isinstance(log, RedisRunLog) and not log.registered:
            return  # never reached Redis (it lost its claim): nothing to delete
        with _reachable("discarding the run"):
            # One key per command: a DEL of several is refused (TRYAGAIN) while the run's
            # slot is being moved with only some of them on the node.
            async with self.redis.pipeline(transaction=False) as pipe:
                for part in ("", "lease", "events"):
                    pipe.delete(self._key(log.run_id, part))
                await pipe.execute()

    async def request_cancel(self, run_id: str, reason: str) -> bool:
        if run_id in self._local and self.cancel_handler is not None:
            return self.cancel_handler(run_id, reason)
        with _reachable("requesting the cancel"):
            if await self._state(run_id) != "running":
                return False
            # The replica running it sees this at its next lease renewal (about a second).
            await self.redis.set(self._key(run_id, "cancel"), reason, px=self._running_ttl_ms)
        return True

    def _index_keys(self, owner: str) -> list[str]:
        """The run indexes a run of ``owner`` is in: every run's, then its principal's."""
        return [self._index_key(None), self._index_key(owner)]

    def _index_key(self, owner: str | None) -> str:
        if owner is None:
            return f"{self.prefix}runs:all"
        # Hashed: a principal id may hold any character.
        return f"{self.prefix}runs:owner:{hashlib.sha256(owner.encode()).hexdigest()[:40]}"

    async def _index_runs(self, logs: list[RedisRunLog], line: _FlushConnection | None = None
                          ) -> None:
        """Puts runs into the ListRuns indexes and pushes the indexes' TTL out. Apart from the
        run's scripts (on a cluster the indexes live in other slots) and best effort: a run
        missing from a listing for a while is better than a call that fails for it. On
        ``line`` (the flusher's own connection) when given, else through the client."""
        if not logs:
            return
        commands: list[tuple[Any, ...]] = []
        for run_log in logs:
            for key in self._index_keys(run_log.owner):
                commands.append(("ZADD", key, run_log.started_ms, run_log.run_id))
                commands.append(("ZREMRANGEBYRANK", key, 0, -(_INDEX_MAX_RUNS + 1)))
                # Every write sets the same TTL from now: it only ever grows.
                commands.append(("PEXPIRE", key, self._running_ttl_ms))
            commands.extend(self._running_commands(run_log))
        try:
            async with asyncio.timeout(self.timeout):
                if line is not None:
                    # The flusher's connection, packed by hiredis: the client's pipeline
                    # costs several times more CPU for the same commands.
                    with _as_redis_error():
                        failed = [r for r in await line.commands(commands)
                                  if isinstance(r, Exception)]
                    if failed:
                        raise failed[0]
                    return
                with _as_redis_error():
                    async with self.redis.pipeline(transaction=False) as pipe:
                        for command in commands:
                            pipe.execute_command(*command)
                        await pipe.execute()
        except (RedisError, TimeoutError) as exc:
            log.warning("redis_run_index_failed", runs=len(logs), error=str(exc) or "timeout")

    def _running_commands(self, run_log: RedisRunLog) -> list[tuple[Any, ...]]:
        """What puts a run just registered into ``runs:running`` (the sweep looks at it once
        its lease could have lapsed), or takes a run whose Result is in Redis out."""
        key = self._running_key
        if run_log.finished and not run_log._pending:  # the Result written (or fenced)
            # A run registered with its Result (most short runs) was never put in.
            return [("ZREM", key, run_log.run_id)] if run_log.swept else []
        run_log.swept = True
        due = int(time.time() * 1000) + self._clock_ahead_ms + self.lease_ms
        return [("ZADD", key, due, run_log.run_id), ("PEXPIRE", key, self._running_ttl_ms)]

    async def page_token_key(self) -> bytes:
        if self._page_token_key is None:
            # One key for every replica: the first to need it writes it, the rest read it.
            # (Lost with Redis's data, it is made again: older tokens are then refused.)
            name = f"{self.prefix}page-token-key"
            with _reachable("reading the page token key"):
                await self.redis.set(name, secrets.token_hex(32), nx=True)
                value = await self.redis.get(name)
            if value is None:  # removed between the two commands: try again next time
                raise Unavailable("the shared run store lost the page token key; retry",
                                  reason="RUN_STORE_UNAVAILABLE",
                                  retry_after=RETRY_AFTER_SECONDS)
            self._page_token_key = value if isinstance(value, bytes) else value.encode()
        return self._page_token_key

    async def list_runs(self, query: RunQuery) -> RunPage:
        key = self._index_key(query.owner)
        top: int | str = "+inf" if query.after is None else query.after[0]
        runs: list[RunSummary] = []
        position: tuple[int, str] | None = None
        offset = 0
        while offset < _LIST_SCAN_MAX:
            with _reachable("listing runs"):
                entries: Any = await self.redis.zrevrangebyscore(
                    key, top, "-inf", start=offset, num=_LIST_CHUNK, withscores=True)
                if not entries:
                    return RunPage(runs, None)
                offset += len(entries)
                # Equal scores come in reverse order of id, as positions compare.
                wanted = [(int(score), member.decode()) for member, score in entries]
                wanted = [at for at in wanted if query.is_after_cursor(at)]
                async with self.redis.pipeline(transaction=False) as pipe:
                    for _, run_id in wanted:
                        pipe.hgetall(self._key(run_id))
                    metas = await pipe.execute()
                expired = [run_id for (_, run_id), meta in zip(wanted, metas, strict=True)
                           if not meta]
                if expired:
                    await self.redis.zrem(key, *expired)
            for (started, run_id), meta in zip(wanted, metas, strict=True):
                if not meta:
                    continue
                summary = self._summary(run_id, started, meta)
                if query.admits(summary):
                    if len(runs) == query.limit:
                        return RunPage(runs, runs[-1].position)
                    runs.append(summary)
                position = (started, run_id)
        # Looked at enough for one call: the next page goes on from here.
        return RunPage(runs, position)

    def _summary(self, run_id: str, started_ms: int, meta: dict[bytes, bytes]) -> RunSummary:
        local = self._local.get(run_id)
        if local is not None:  # running here: fresher than what was last written
            return local.summary()
        written = json.loads(meta.get(b"summary", b"{}"))
        finished = meta.get(b"state", b"running") != b"running"
        # A run ended by the store (its replica lost, a conflict) has no outcome written.
        outcome = int(written.get("outcome", 0)) or (events_pb2.OUTCOME_ERROR if finished else 0)
        return RunSummary(run_id, meta.get(b"owner", b"").decode(),
                          meta.get(b"tool", b"").decode(), started_ms, finished=finished,
                          outcome=outcome, ended_ms=int(written.get("ended", 0)),
                          last_seq=int(written.get("seq", 0)),
                          current_step="" if finished else str(written.get("step", "")))

    async def request_steer(self, run_id: str, message: str, source: str) -> None:
        if run_id in self._local:
            if self.steer_handler is None or not self.steer_handler(run_id, message, source):
                raise run_finished_error(run_id)
            return
        payload = json.dumps({"message": message, "source": source})
        with _reachable("steering the run"):
            # The replica running it picks this up at its next lease renewal (about a
            # second). The script names the steer list, which mostly does not exist yet: while
            # the run's slot moves, Redis refuses it (TRYAGAIN) without running it, so it is
            # sent again until the slot has moved or the call's time is up.
            deadline = time.monotonic() + self.timeout
            while True:
                try:
                    left = await self._steer_script(
                        keys=[self._key(run_id), self._key(run_id, "steer")],
                        args=[self.max_pending_steers, payload, self._running_ttl_ms])
                    break
                except _SLOT_MOVING:
                    if time.monotonic() + _SLOT_MOVING_RETRY_SECONDS >= deadline:
                        raise
                    await asyncio.sleep(_SLOT_MOVING_RETRY_SECONDS)
        if left == -1:
            raise run_finished_error(run_id)
        if left == 0:
            raise ResourceExhausted(
                f"the run already holds {self.max_pending_steers} unread steering messages",
                retry_after=RETRY_AFTER_SECONDS, reason=reason_name(errors_pb2.STEER_QUEUE_FULL),
                metadata={"run_id": run_id})

    async def flushed(self, within: float) -> bool:
        """Waits until every event appended so far is in Redis, at most ``within`` seconds;
        whether it is."""
        if self._flusher is None or self._flusher.done():
            return not self._dirty
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._flushed.wait(), within)
        return self._flushed.is_set()

    async def start(self) -> None:
        """Starts sweeping for lost runs in the background (see the module docstring): the
        server calls it when it starts, whether or not this replica runs anything."""
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.create_task(self._sweep_loop(), name="redis-run-sweep")

    async def aclose(self) -> None:
        """Flushes what runs of this replica still hold, stops renewing and sweeping,
        disconnects."""
        await self.flushed(5.0)
        tasks = [t for t in (self._renewer, self._flusher, self._sweeper) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._linger is not None:
            self._linger.cancel()
        if self._flush_line is not None:
            await self._flush_line.aclose()
        await self.redis.aclose()

    # -- internals -------------------------------------------------------------------------

    def _token(self, run_id: str) -> str:
        return f"{self.replica}/{run_id}"

    def _forget(self, log: RedisRunLog) -> None:
        # The run is finished and fully in Redis: readers from now on read it there.
        self._local.pop(log.run_id, None)

    def _run_keys(self, run_id: str) -> list[str]:
        """The keys of a run as the scripts take them: lease, events, meta."""
        return self.keys.run_keys(run_id)

    def _with_claim(self, keys: list[str], claim_key: str) -> list[str]:
        """``keys`` and the claim key, where one script may touch both (one Redis)."""
        return [*keys, claim_key] if claim_key and not self.cluster else keys

    def _append_call(self, log: RedisRunLog, batch: list[tuple[int, bytes, bool]]
                     ) -> tuple[list[str], list[Any]]:
        """The keys and arguments of the :data:`_APPEND` script call writing ``batch``."""
        args: list[Any] = [self._token(log.run_id), self.lease_ms, self.max_events,
                           "1" if batch[-1][2] else "0", self.retention_ms,
                           self._running_ttl_ms]
        if log.registered:
            args.extend(("0", "", "", self.replica))
        else:
            args.extend(("1", log.owner, log.tool, self.replica))
        final = batch[-1][2]
        summary = {"seq": batch[-1][0], "step": "" if final else log.current_step}
        if final:
            summary.update(outcome=log.outcome, ended=log.ended_ms)
        args.extend((json.dumps(summary), batch[0][0]))
        args.extend(data for _, data, _ in batch)
        return self._with_claim(self._run_keys(log.run_id), log.claim_key), args

    async def _call(self, script: AsyncScript, keys: list[str], args: list[Any]) -> Any:
        """Runs ``script`` once, waiting for ``wait_replicas`` acknowledgements; its reply.

        Raises:
            RedisError: Redis could not be reached, answered with an error, or (see
                :class:`NotReplicated`) not enough replicas acknowledged the write.
        """
        reply = (await self._call_all(script, [(keys, args)], durable=True))[0]
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def _call_all(self, script: AsyncScript, calls: list[tuple[list[str], list[Any]]],
                        line: _FlushConnection | None = None, *, durable: bool = False
                        ) -> list[Any]:
        """Runs ``script`` once per (keys, args) in one pipeline (one round trip), on
        ``line`` when given; each reply, or the error of that call. Loads the script first
        if Redis lost it (it was restarted). A ``durable`` write then waits (WAIT, on the
        same connections) for ``wait_replicas`` replicas to acknowledge it.

        Raises:
            RedisError: Redis could not be reached, or (:class:`NotReplicated`) not enough
                replicas acknowledged a durable write.
        """
        wait = (self.wait_replicas, self.wait_timeout_ms) if durable and self.wait_replicas \
            else None
        with _as_redis_error():
            if line is not None:
                replies = await line.call_all(script.sha, calls, wait)
            elif len(calls) == 1 and wait is None and not self.cluster:
                replies = [await self._one(self.redis, script.sha, *calls[0])]
            else:
                replies = await self._pipelined(script.sha, calls, wait)
        missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if missing:
            await self.redis.script_load(script.script)
            again = await self._pipelined(script.sha, [calls[i] for i in missing], wait)
            for i, reply in zip(missing, again, strict=True):
                replies[i] = reply
        return replies

    @staticmethod
    async def _one(redis: Redis | RedisCluster, sha: str, keys: list[str], args: list[Any]
                   ) -> Any:
        # As one reply of a pipeline: Redis's answer, or the error Redis answered with.
        try:
            return await redis.evalsha(sha, len(keys), *keys, *args)
        except ResponseError as exc:
            return exc

    async def _pipelined(self, sha: str, calls: list[tuple[list[str], list[Any]]],
                         wait: tuple[int, int] | None = None) -> list[Any]:
        """The calls in one pipeline of the client (on a cluster: one per node, sent
        together), then WAIT on each connection that carried a write when ``wait`` says."""
        nodes: dict[str, Any] = {}
        async with self.redis.pipeline(transaction=False) as pipe:
            for keys, args in calls:
                pipe.execute_command("EVALSHA", sha, len(keys), *keys, *args)
                if wait is not None and isinstance(self.redis, RedisCluster):
                    node = self.redis.get_node_from_key(keys[0])
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
        redirected = [i for i, reply in enumerate(replies[:len(calls)])
                      if isinstance(reply, AskError)]  # MOVED or ASK
        if redirected and wait is not None:
            # The WAITs above count the writes of the nodes the calls were sent to, not of
            # the node a redirected call would be sent to again: a redirected durable write
            # is answered with its redirect (one of _SLOT_MOVING: a claim tries again, a
            # flush writes again shortly). A MOVED slot is noted first, so that the call is
            # then sent (with its WAIT) to the node that serves it now.
            for i in redirected:
                if isinstance(replies[i], MovedError) and isinstance(self.redis, RedisCluster):
                    await self.redis.nodes_manager.move_slot(replies[i])
        elif redirected:
            again = await asyncio.gather(*(self._one(self.redis, sha, *calls[i])
                                           for i in redirected), return_exceptions=True)
            for i, reply in zip(redirected, again, strict=True):
                replies[i] = reply
        if wait is not None:
            _check_acknowledged(replies[len(calls):], *wait)
        return replies[:len(calls)]

    def _failed(self, exc: Exception) -> None:
        """Notes a failed write: when Redis was unreachable, new runs without a key are
        refused until a PING gets through (a full pool is load, not an outage)."""
        if isinstance(exc, (RedisConnectionError, RedisTimeoutError, TimeoutError)) and \
                not isinstance(exc, MaxConnectionsError):
            self.healthy = False

    def _wants_flush(self, log: RedisRunLog) -> None:
        self._dirty[log.run_id] = log
        self._flushed.clear()
        self._schedule_flush(urgent=log.finished)
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush_loop(), name="redis-flush")

    def _schedule_flush(self, *, urgent: bool) -> None:
        """Wakes the flusher now (a Result: its caller may watch it on another replica), or
        after a short linger that lets more events of this and other runs join the round
        trip. A timer rather than a wake-up: the flusher runs once per round trip, not once
        per event."""
        if urgent:
            self._flush_now.set()
        elif self._linger is None and not self._flush_now.is_set():
            self._linger = asyncio.get_running_loop().call_later(_FLUSH_LINGER,
                                                                 self._flush_now.set)

    async def _flush_loop(self) -> None:
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
            except Exception:  # the flusher writes every run's events: it must go on
                log.exception("redis_flush_error")
                for run_log in logs.values():
                    self._dirty.setdefault(run_log.run_id, run_log)
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
                self._schedule_flush(urgent=any(log.finished for log in self._dirty.values()))
            else:
                self._flushed.set()

    async def _flush(self, logs: list[RedisRunLog]) -> bool:
        """Writes the next batch of each log, in one round trip; False when some failed
        (their events are kept, to be written again)."""
        batches = [(run_log, run_log.next_batch()) for run_log in logs
                   if run_log._pending and not run_log.lease_lost]
        if not batches:
            return True
        # Runs this round trip registers or ends go into (or stay in) the ListRuns indexes.
        to_index = [run_log for run_log, batch in batches
                    if not run_log.registered or batch[-1][2]]
        # Whatever fails is kept and written again: local readers are unaffected, remote
        # watchers wait, and the lease (renewed by these writes) is at stake.
        try:
            async with asyncio.timeout(self.flush_timeout):
                replies = await self._call_all(self._append_script, [
                    self._append_call(run_log, batch) for run_log, batch in batches],
                    self._flush_line, durable=True)
        except (RedisError, TimeoutError) as exc:
            self._failed(exc)
            log.warning("redis_flush_failed", runs=len(batches),
                        error=str(exc) or "no answer in time")
            self._dirty.update((run_log.run_id, run_log) for run_log, _ in batches)
            return False
        ok = True
        for (run_log, batch), reply in zip(batches, replies, strict=True):
            if isinstance(reply, Exception):
                self._failed(reply)
                if isinstance(reply, _SLOT_MOVING):
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
            self.healthy = True
            run_log.registered = True
            if reply[0] == -1:
                self._lease_lost(run_log)
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
            del run_log._pending[:len(batch)]
            if batch[-1][2]:  # the Result is in Redis: done
                self._forget(run_log)
            elif run_log._pending:
                self._dirty[run_log.run_id] = run_log
        await self._index_runs([run_log for run_log in to_index if run_log.registered],
                               self._flush_line)
        return ok

    def _stop_writing(self, run_log: RedisRunLog) -> None:
        run_log.lease_lost = True
        run_log._pending.clear()
        self._dirty.pop(run_log.run_id, None)
        self._forget(run_log)

    def _lease_lost(self, run_log: RedisRunLog) -> None:
        """Fences a run that another replica declared lost: this replica writes nothing more
        of it and stops it with the same ``Result{ERROR, RUN_LOST}`` every watcher got, so
        that a retry with its key (which now runs the tool again) never runs beside it."""
        log.error("run_lease_lost", run_id=run_log.run_id,
                  detail="another replica declared this run lost; stopping it here")
        self._stop_writing(run_log)
        if self.cancel_handler is not None:
            self.cancel_handler(run_log.run_id, "the run store declared this run lost (its "
                                "lease lapsed); retry with the same idempotency key",
                                "RUN_LOST")

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
            await self._end(run_log.run_id, "STORE_CONFLICT", message,
                            self._token(run_log.run_id))
        except RedisError as exc:  # its lease lapses and the run ends RUN_LOST instead
            log.warning("redis_store_conflict_not_recorded", run_id=run_log.run_id,
                        error=str(exc))
        if self.cancel_handler is not None:
            self.cancel_handler(run_log.run_id, message, "STORE_CONFLICT")

    def _hand_over_steer(self, run_id: str, payload: bytes) -> None:
        """Steers a run of this replica with a message another replica left for it."""
        try:
            steer = json.loads(payload)
            if self.steer_handler is not None:
                self.steer_handler(run_id, str(steer["message"]), str(steer["source"]))
        except (RequestError, ValueError, KeyError, TypeError) as exc:
            # Checked on the other replica already; what fails now (the run ended, or its
            # queue filled up meanwhile) has no caller left to tell.
            log.warning("steer_not_handed_over", run_id=run_id, error=str(exc))

    async def _state(self, run_id: str) -> str:
        """running | finished | lost | orphaned (running, lease expired) | missing."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hget(self._key(run_id), "state")
            pipe.exists(self._key(run_id, "lease"))
            state, leased = await pipe.execute()
        if state is None:
            return "missing"
        if state == b"running":
            return "running" if leased else "orphaned"
        return str(state.decode())

    async def _end_if_lost(self, run_id: str) -> None:
        """Appends ``Result{ERROR, RUN_LOST}`` to a run whose replica stopped renewing its
        lease without writing a Result, once the lease has stayed lapsed for a whole lease
        period (see :data:`_END`); does nothing to a live or finished run."""
        if await self._state(run_id) == "orphaned":
            await self._end(run_id, "RUN_LOST", _LOST_MESSAGE, noticed_by="call")

    async def _end(self, run_id: str, code: str, message: str, token: str = "",
                   **seen: str) -> bool:
        """Appends a terminal ``Result{ERROR, code}`` after the events in Redis: to a lost
        run (``token`` empty), or to a run of this replica holding the lease ``token``.
        Whether it was appended. ``seen`` goes into the log line (what the sweep knew)."""
        for _ in range(5):
            last: Any = await self.redis.xrevrange(self._key(run_id, "events"), count=1)
            last_id = last[0][0].decode() if last else "0-0"
            seq = int(last_id.split("-", 1)[0]) + 1
            event = events_pb2.RunEvent(run_id=run_id, seq=seq)
            event.time.GetCurrentTime()
            event.result.outcome = events_pb2.OUTCOME_ERROR
            event.result.error.code = code
            event.result.error.message = message
            done = await self._call(self._end_script, self._run_keys(run_id), [
                last_id, f"{seq}-0", event.SerializeToString(), self.retention_ms, token,
                self.lease_ms, "lost" if code == "RUN_LOST" else "finished"])
            if done != -2:  # -2: an event landed in between; look again
                if done == 1:
                    log.warning("run_lost" if code == "RUN_LOST" else "run_ended_in_store",
                                run_id=run_id, code=code, **seen)
                    if code == "RUN_LOST":
                        metrics.RUNS_LOST.labels(seen.get("noticed_by", "call")).inc()
                return bool(done == 1)
        return False

    async def _undo_abandoned(self) -> None:
        """Undoes the claims whose calls gave up (see :data:`_ABANDON`), in one round trip."""
        # Taken now: calls giving up meanwhile add to it while these round trips wait.
        abandoned = list(self._abandoned.items())
        calls = []
        for run_id, (claim_key, mine, deadline_ms) in abandoned:
            event = events_pb2.RunEvent(run_id=run_id, seq=1)
            event.time.GetCurrentTime()
            event.result.outcome = events_pb2.OUTCOME_ERROR
            event.result.error.code = "RUN_LOST"
            event.result.error.message = ("the call that started this run gave up before it "
                                          "began (the run store did not answer in time); "
                                          "retry with the same idempotency key")
            calls.append((self._with_claim(self._run_keys(run_id), claim_key),
                          [mine, deadline_ms, self._token(run_id), event.SerializeToString(),
                           self.retention_ms]))
        replies = await self._call_all(self._abandon_script, calls, durable=True)
        if self.cluster:  # the claims live in other slots: their half, in the same way
            claims = await self._call_all(self._abandon_claim_script, [
                ([claim_key], [mine, deadline_ms])
                for _, (claim_key, mine, deadline_ms) in abandoned], durable=True)
            replies = [1 if (run, claim) == (1, 1) else 0
                       for run, claim in zip(replies, claims, strict=True)]
        for (run_id, _), reply in zip(abandoned, replies, strict=True):
            if reply == 1:
                self._abandoned.pop(run_id, None)

    async def _renew_loop(self) -> None:
        interval = min(1.0, self.lease_ms / 3000)
        while True:
            await asyncio.sleep(interval)
            try:
                await self._renew_once()
            except Exception:  # one bad round must not end the renewal of every run
                log.exception("redis_lease_renewal_error")

    async def _renew_once(self) -> None:
        """Undoes abandoned claims, then renews the lease of every run of this replica (in
        one round trip) and hands over what other replicas left for them."""
        if self._abandoned:
            try:
                await self._undo_abandoned()
            except RedisError as exc:
                log.warning("redis_abandoned_claims_not_undone", error=str(exc))
        # An unregistered run has no lease yet: its first flush sets it.
        runs = [run_log for run_log in self._local.values()
                if run_log.registered and not run_log.finished]
        if not runs:
            return
        try:  # every run's renewal in one round trip
            replies = await self._call_all(self._renew_script, [(
                self._renew_keys(run_log),
                [self._token(run_log.run_id), self.lease_ms, self._running_ttl_ms,
                 self.replica, run_log.claim_value],
            ) for run_log in runs])
            if self.cluster:
                renewed = [(i, run_log) for i, (run_log, reply)
                           in enumerate(zip(runs, replies, strict=True))
                           if not isinstance(reply, Exception) and reply[0] != -1]
                claimed = [run_log for _, run_log in renewed if run_log.claim_key]
                if claimed:  # a cluster keeps their claims, in their own slots, alike
                    await self._call_all(self._renew_claim_script, [
                        ([run_log.claim_key], [run_log.claim_value, self._running_ttl_ms])
                        for run_log in claimed])
                for (i, _), reply in zip(renewed, await self._pending_for(
                        [run_log for _, run_log in renewed]), strict=True):
                    replies[i] = reply
        except RedisError as exc:
            self._failed(exc)
            log.warning("redis_lease_renewal_failed", error=str(exc))
            return
        for run_log, reply in zip(runs, replies, strict=True):
            if isinstance(reply, Exception):
                log.warning("redis_lease_renewal_failed", run_id=run_log.run_id,
                            error=str(reply))
                continue
            if reply[0] == -1:
                if not run_log.lease_lost:
                    self._lease_lost(run_log)
                continue
            if reply[0] == 1 and self.cancel_handler is not None:
                self.cancel_handler(run_log.run_id, reply[1].decode(errors="replace"))
            for payload in reply[2:]:
                self._hand_over_steer(run_log.run_id, payload)

    def _renew_keys(self, run_log: RedisRunLog) -> list[str]:
        """The keys of a run's :data:`_RENEW` call: on a cluster only those a running run
        has (see there)."""
        keys = self._run_keys(run_log.run_id)
        if self.cluster:
            return keys
        return self._with_claim([*keys, self._key(run_log.run_id, "cancel"),
                                 self._key(run_log.run_id, "steer")], run_log.claim_key)

    async def _pending_for(self, runs: list[RedisRunLog]) -> list[list[Any]]:
        """On a cluster, after their leases were renewed: each run's pending cancel and
        steering messages, as :data:`_RENEW` reports them on one Redis. Single-key commands,
        which a node serves (or redirects with ASK) while the run's slot is being moved."""
        if not runs:
            return []
        with _as_redis_error():
            async with self.redis.pipeline(transaction=False) as pipe:
                for run_log in runs:
                    pipe.get(self._key(run_log.run_id, "cancel"))
                    pipe.lpop(self._key(run_log.run_id, "steer"), self.max_pending_steers)
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

    # -- sweeping for lost runs ------------------------------------------------------------

    async def _sweep_loop(self) -> None:
        # Jittered, so that replicas started together do not sweep in step; never past the
        # interval, which the bound on declaring a run lost counts with.
        while True:
            await asyncio.sleep(self.sweep_interval * (0.5 + random.random() / 2))
            more = True
            while more:  # a full batch: more are due, taken batch by batch
                more = False
                try:
                    # Bounded: a stalled Redis holds a round trip until it resumes when the
                    # client has no socket timeout of its own.
                    async with asyncio.timeout(4 * self.flush_timeout):
                        with _as_redis_error():
                            more = await self._sweep_once() == _SWEEP_MAX_RUNS
                except (RedisError, TimeoutError) as exc:
                    log.warning("redis_sweep_failed", error=str(exc) or "no answer in time")
                except Exception:  # one bad sweep must not end the sweeping
                    log.exception("redis_sweep_error")

    async def _sweep_once(self) -> int:
        """Looks at the runs of ``runs:running`` that are due (at most
        :data:`_SWEEP_MAX_RUNS`): ends those whose lease has stayed lapsed for the grace,
        takes finished and expired ones out, and puts the others back for when they are due
        again. How many it took.

        Raises:
            RedisError: Redis could not be reached (the runs taken are due again a lease
                later, for any sweeper).
        """
        key = self._running_key
        taken: Any = await self._sweep_take_script(
            keys=[key], args=[_SWEEP_MAX_RUNS, self.lease_ms, self._running_ttl_ms])
        now_ms, run_ids = int(taken[0]), [raw.decode() for raw in taken[1:]]
        if not run_ids:
            return 0
        async with self.redis.pipeline(transaction=False) as pipe:
            for run_id in run_ids:
                pipe.hmget(self._key(run_id), "state", "lapsed", "replica", "tool")
                pipe.pttl(self._key(run_id, "lease"))
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
                due[run_id] = now_ms + (ttl if ttl >= 0 else self.lease_ms)
            elif (local := self._local.get(run_id)) is not None and not local.lease_lost:
                # Running here: its next renewal takes the lease back (Redis stalled).
                due[run_id] = now_ms + int(self.sweep_interval * 1000)
            elif lapsed is not None and now_ms < int(lapsed) + self.lease_ms:
                due[run_id] = int(lapsed) + self.lease_ms  # in its grace
            elif await self._sweep_end(run_id, replica, tool):
                gone.append(run_id)
            else:  # just seen lapsed (its grace starts now), or its lease was taken back
                due[run_id] = now_ms + int(self.sweep_interval * 1000)
        async with self.redis.pipeline(transaction=False) as pipe:
            for run_id, at in due.items():
                pipe.zadd(key, {run_id: at}, xx=True)  # unless it ended meanwhile
            if gone:
                pipe.zrem(key, *gone)
            await pipe.execute(raise_on_error=False)
        return len(run_ids)

    async def _sweep_end(self, run_id: str, replica: bytes | None, tool: bytes | None) -> bool:
        """Ends a run the sweep found lapsed, if it has stayed lapsed for the grace (the
        first sighting starts it); whether it was ended. A refusal of this run's script (its
        slot being moved) is logged and left for the next look.

        Raises:
            RedisError: Redis could not be reached.
        """
        try:
            return await self._end(run_id, "RUN_LOST", _LOST_MESSAGE, noticed_by="sweep",
                                   replica=(replica or b"").decode(errors="replace"),
                                   tool=(tool or b"").decode(errors="replace"))
        except (ResponseError, ClusterError) as exc:
            log.warning("redis_sweep_failed", run_id=run_id, error=str(exc))
            return False
