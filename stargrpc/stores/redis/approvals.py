"""Approval records in Redis (:class:`RedisApprovalStore`), shared by every replica.

Keys (under ``redis_key_prefix``)::

    approval:{<run id>}   hash   the fields of an ApprovalRecord, plus id_hash (SHA-256 of
                                 the approval id); expires with the run's retention

Each change is one script on that one key (so one slot on a Redis Cluster): the decision
and the timeout (or withdrawal) compare the state, the approval id's hash and the
arguments' digest and set the new state in one step, so a record leaves ``pending`` once.

ApproveRun lands on any replica. The replica whose run waits learns of the decision the way
a remote cancel or steer reaches a run: it looks. One task per replica reads, in one
pipeline, the state of every record its waiting runs wait on, every ``poll_interval``
seconds while at least one waits (a decision taken on this replica wakes its run at once).
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from stargrpc.stores.approvals import (
    DECIDED,
    PENDING,
    ApprovalRecord,
    id_hash,
    wait_set,
)
from stargrpc.stores.background import stop_background
from stargrpc.stores.redis.errors import reachable
from stargrpc.stores.redis.scripts import NOW_MS

log = structlog.get_logger("stargrpc.stores.redis")

# KEYS: record · ARGV: id_hash, digest ('' = any), state, approver, reason.
# Returns {verdict, fields...}: missing | not_pending | id_mismatch | digest_mismatch | decided.
DECIDE = NOW_MS + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'missing'} end
local state = redis.call('HGET', KEYS[1], 'state')
local verdict = 'decided'
if state ~= 'pending' then
  verdict = 'not_pending'
elseif redis.call('HGET', KEYS[1], 'id_hash') ~= ARGV[1] then
  verdict = 'id_mismatch'
elseif ARGV[2] ~= '' and redis.call('HGET', KEYS[1], 'digest') ~= ARGV[2] then
  verdict = 'digest_mismatch'
else
  redis.call('HSET', KEYS[1], 'state', ARGV[3], 'approver', ARGV[4], 'reason', ARGV[5],
             'decided_ms', now_ms())
end
local reply = {verdict}
for _, v in ipairs(redis.call('HGETALL', KEYS[1])) do reply[#reply + 1] = v end
return reply
"""

# KEYS: record · ARGV: state, reason. Returns the record's fields after (empty when gone).
SETTLE = NOW_MS + """
if redis.call('HGET', KEYS[1], 'state') == 'pending' then
  redis.call('HSET', KEYS[1], 'state', ARGV[1], 'reason', ARGV[2], 'decided_ms', now_ms())
end
return redis.call('HGETALL', KEYS[1])
"""


class RedisApprovalStore:
    """The :class:`~stargrpc.stores.approvals.ApprovalStore` of a fleet (the run store's
    ``approvals``); see the module for the layout and how a decision reaches its run."""

    def __init__(self, redis: Redis | RedisCluster, *, prefix: str = "stargrpc:",
                 poll_interval: float = 0.25) -> None:
        """
        Args:
            redis: The client (one Redis or a cluster).
            prefix: Prefix of every key.
            poll_interval: Seconds between two looks at the records this replica's runs
                wait on.
        """
        self._redis = redis
        self._prefix = prefix
        self._poll_interval = poll_interval
        self._decide = redis.register_script(DECIDE)
        self._settle = redis.register_script(SETTLE)
        self._waiting: dict[str, asyncio.Event] = {}
        self._poller: asyncio.Task[None] | None = None

    def key(self, run_id: str) -> str:
        """The key of the record of ``run_id`` (its own slot on a cluster)."""
        return f"{self._prefix}approval:{{{run_id}}}"

    async def put(self, record: ApprovalRecord, ttl_ms: int) -> None:
        with reachable("storing the approval request"):
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.hset(self.key(record.run_id), items=[
                    part for pair in record.as_fields().items() for part in pair])
                pipe.pexpire(self.key(record.run_id), max(1, ttl_ms))
                await pipe.execute()

    async def get(self, run_id: str) -> ApprovalRecord | None:
        with reachable("reading the approval request"):
            fields = await self._redis.hgetall(self.key(run_id))
        return _record(fields)

    async def get_many(self, run_ids: list[str]) -> dict[str, ApprovalRecord]:
        if not run_ids:
            return {}
        with reachable("reading approval requests"):
            async with self._redis.pipeline(transaction=False) as pipe:
                for run_id in run_ids:
                    pipe.hgetall(self.key(run_id))
                replies = await pipe.execute()
        found = {run_id: _record(fields) for run_id, fields in zip(run_ids, replies, strict=True)}
        return {run_id: record for run_id, record in found.items() if record is not None}

    async def decide(self, run_id: str, approval_id: str, digest: str, state: str,
                     approver: str, reason: str) -> tuple[str, ApprovalRecord | None]:
        with reachable("deciding on the approval request"):
            reply = await self._decide(keys=[self.key(run_id)], args=[
                id_hash(approval_id), digest, state, approver, reason])
        verdict = _text(reply[0])
        record = _record(_pairs(reply[1:]))
        if verdict == DECIDED:
            self._wake(run_id)
        return verdict, record

    async def settle(self, run_id: str, state: str, reason: str) -> ApprovalRecord | None:
        with reachable("settling the approval request"):
            reply = await self._settle(keys=[self.key(run_id)], args=[state, reason])
        return _record(_pairs(reply))

    async def wait(self, run_id: str, within: float) -> ApprovalRecord | None:
        record = await self.get(run_id)
        if record is None or not record.pending:
            return record
        event = self._waiting.setdefault(run_id, asyncio.Event())
        if self._poller is None or self._poller.done():
            self._poller = asyncio.create_task(self._poll(), name="approval-poller")
        try:
            await wait_set(event, within)
        finally:
            self._waiting.pop(run_id, None)
        return await self.get(run_id)

    def _wake(self, run_id: str) -> None:
        event = self._waiting.get(run_id)
        if event is not None:
            event.set()

    async def _poll(self) -> None:
        """Looks at the records this replica's runs wait on until none waits."""
        while self._waiting:
            await asyncio.sleep(self._poll_interval)
            run_ids = [run_id for run_id, event in self._waiting.items() if not event.is_set()]
            if not run_ids:
                continue
            try:
                async with self._redis.pipeline(transaction=False) as pipe:
                    for run_id in run_ids:
                        pipe.hget(self.key(run_id), "state")
                    states = await pipe.execute(raise_on_error=False)
            except Exception:  # the next round tries again; the waits have their timeouts
                log.warning("redis_approval_poll_failed", waiting=len(run_ids), exc_info=True)
                continue
            for run_id, state in zip(run_ids, states, strict=True):
                if isinstance(state, Exception):
                    continue
                if state is None or _text(state) != PENDING:
                    self._wake(run_id)

    async def aclose(self) -> None:
        task, self._poller = self._poller, None
        await stop_background(task, "approval-poller")


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _pairs(flat: list[Any]) -> dict[str, str]:
    return {_text(flat[i]): _text(flat[i + 1]) for i in range(0, len(flat) - 1, 2)}


def _record(fields: dict[Any, Any]) -> ApprovalRecord | None:
    if not fields:
        return None
    try:
        return ApprovalRecord.from_fields({_text(k): _text(v) for k, v in fields.items()})
    except (KeyError, ValueError):
        log.warning("redis_approval_record_unreadable", fields=sorted(map(_text, fields)))
        return None
