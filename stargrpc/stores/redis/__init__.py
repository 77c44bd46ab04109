"""The run store of a fleet: run logs, owners, idempotency claims and leases in Redis.

Keys (all under ``redis_key_prefix``)::

    run:{id}          hash    owner, tool, replica, state (running | finished | lost)
    run:{id}:events   stream  one entry per event, entry id "{seq}-0", field e = RunEvent bytes
    run:{id}:lease    string  the running replica's token; expires unless renewed
    run:{id}:cancel   string  a CancelRun reason for the replica running the run
    run:{id}:steer    list    SteerRun messages (JSON) for the replica running the run
    runs:all          zset    every run's id, scored by its start (ms since the epoch)
    runs:owner:{hash} zset    the same for the runs of one principal (ListRuns)
    runs:tree:{hash}  zset    the runs of one call tree (its root and every run below it),
                              written by the runs below the root (ListRuns root_run_id,
                              and CancelRun's cascade to other replicas)
    runs:tree:{hash}:count string the runs started below that root on every replica
                              (max_runs_per_tree)
    runs:running      zset    the id of every running run, scored by when the sweep looks
                              at it next (its lease's expiry as last seen, ms, Redis's clock)
    idem:{digest}     string  JSON {fp, run} — the idempotency claim of (principal, key)
    approval:{id}     hash    a run's approval request and decision (approvals.py)

The meta hash also holds ``summary`` (JSON: last seq, current step, outcome and end, as of
the run's last written batch; for a run below a root also ``parent``, ``root`` and
``depth``, which a replica hanging a run under it reads), which ListRuns shows. The
indexes are written apart from the run's scripts (on a cluster they live in slots of their
own), when a run is registered and when it ends; they expire like the runs (each write
pushes their TTL out) and drop the ids of expired runs when a listing comes across them.

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
sooner waits for that write, going by the time in the run id: see
:meth:`RedisRunStore.open`). A
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
(:data:`.scripts.SWEEP_TAKE`) — and looking at each: a live lease puts the run back until it
could lapse, a finished or expired run leaves the set, and a lapsed one goes through the
same once-only end-if-lost as a watcher's (:data:`.scripts.END`, with its whole further
lease of grace). A run of a dead replica so ends ``RUN_LOST`` within about two leases of
the death (a lease, the grace, and a sweep interval after each), and a delivery of its
Result taken over by another replica finds it. A sweep that cannot reach Redis is logged
and tried again at the next interval.

Idempotency claims are ``SET NX`` with a TTL (the retention, renewed while the run goes).
Streams are trimmed to ``run_max_events`` and expire ``run_retention_seconds`` after the
Result. Any Redis error becomes :class:`~stargrpc.errors.Unavailable`: the call fails fast
with UNAVAILABLE, and the next call reconnects (the mapping is one table:
:data:`~stargrpc.stores.redis.errors.FAILURES`).

The package's rooms, each owning one thing and talking to the others through methods
(``tests/stores/test_redis_rooms.py`` holds them to it)::

    scripts.py     the Lua scripts and their contracts (Redis's TIME read once, in NOW_MS);
                   Scripts runs them: one call, a pipeline, WAIT for replicas, reload
    connection.py  FlushConnection: the flusher's own connection, driven directly
    errors.py      Redis failures → RequestError (FAILURES), NotReplicated, SLOT_MOVING
    shared.py      Shared: the client, key layout, limits, this replica's runs, health and
                   Redis's clock as the rooms share them
    logs.py        RedisRunLog (written here), RemoteRunLog (read from Redis), LocalRuns
    leases.py      Leases (renewal, a run's state, ending lost runs), Sweep (runs:running)
    index.py       RunIndex: the ListRuns indexes, listing, the page token key
    flusher.py     Flusher: pending events to Redis in batches; fencing a lost run
    claims.py      Claims: registering before a run starts, idempotency claims, undoing
                   those whose call gave up
    store.py       RedisRunStore: the RunStore the runtime uses, a facade over the rooms
    state.py       RedisStateStore: run state (ctx.state), a scope's keys under one hash
                   tag, one script per operation; the store's ``state``
    approvals.py   RedisApprovalStore: approval requests and decisions, one key per run;
                   how a decision reaches the replica whose run waits; the store's
                   ``approvals``
    lanes.py       RedisLanes: the fleet's lanes (slots and queues in sorted sets, held by
                   leases; slots a replica leases ahead while nobody waits), one script
                   per step; the store's ``lanes_for``
"""

from __future__ import annotations

from stargrpc.stores.redis.connection import FlushConnection
from stargrpc.stores.redis.errors import RETRY_AFTER_SECONDS, NotReplicated
from stargrpc.stores.redis.logs import RedisRunLog, RemoteRunLog
from stargrpc.stores.redis.state import RedisStateStore
from stargrpc.stores.redis.store import MAX_FRESH_RUN_WAITS, RedisRunStore

__all__ = [
    "MAX_FRESH_RUN_WAITS",
    "RETRY_AFTER_SECONDS",
    "FlushConnection",
    "NotReplicated",
    "RedisRunLog",
    "RedisRunStore",
    "RedisStateStore",
    "RemoteRunLog",
]
