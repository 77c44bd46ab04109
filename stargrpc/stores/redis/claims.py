"""Registering a run before it starts, and idempotency claims: taken with the run's
registration (one Redis) or after it (a cluster), void when applied after the call's
deadline by Redis's clock, and undone in the background when their call gave up."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import structlog
from redis.exceptions import RedisError

from stargrpc.errors import Unavailable
from stargrpc.stores.base import Claim
from stargrpc.stores.redis.errors import (
    RETRY_AFTER_SECONDS,
    SLOT_MOVING,
    ClaimTooLate,
    reachable,
    request_error,
)
from stargrpc.stores.redis.index import RunIndex
from stargrpc.stores.redis.leases import Leases, error_result
from stargrpc.stores.redis.logs import RedisRunLog
from stargrpc.stores.redis.shared import Shared

log = structlog.get_logger("stargrpc.stores.redis")

#: How long a claim waits before it tries again while its slots are being moved (TRYAGAIN).
SLOT_MOVING_RETRY_SECONDS = 0.05
#: The message of the Result of a run whose claim was undone.
_ABANDONED_MESSAGE = ("the call that started this run gave up before it began (the run "
                      "store did not answer in time); retry with the same idempotency key")


class Claims:
    """Runs registered before they start, and the idempotency claims that name them."""

    _shared: Shared
    _leases: Leases
    _index: RunIndex
    _abandoned: dict[str, tuple[str, str, int]]

    def __init__(self, shared: Shared, leases: Leases, index: RunIndex) -> None:
        self._shared = shared
        self._leases = leases
        self._index = index
        # Claims whose call gave up, by run id: (claim key, its value, deadline in ms since
        # the epoch). Undone once Redis's clock is past the deadline.
        self._abandoned = {}

    async def register(self, run_log: RedisRunLog) -> None:
        """Registers a run (lease and meta hash) before it starts, unless its claim did.

        Raises:
            RequestError: Redis did not answer before the call's deadline (UNAVAILABLE).
        """
        shared = self._shared
        if run_log.registered:
            return  # by its claim
        try:
            async with asyncio.timeout(max(0.0, run_log.deadline - time.monotonic())):
                with reachable("registering the run"):
                    while True:
                        try:
                            reply = await shared.scripts.call(
                                shared.scripts.register_run, shared.run_keys(run_log.run_id), [
                                    shared.token(run_log.run_id), shared.lease_ms,
                                    shared.running_ttl_ms, run_log.owner, run_log.tool,
                                    shared.replica, shared.deadline_ms(run_log.deadline)],
                                before=self._index.sweep_commands([run_log]))
                        except SLOT_MOVING:
                            await asyncio.sleep(SLOT_MOVING_RETRY_SECONDS)
                            continue
                        if reply[0] == 1:
                            break
                        if not shared.clock_ran_ahead(int(reply[1])):
                            raise ClaimTooLate
        except (TimeoutError, ClaimTooLate) as exc:
            raise request_error(exc, "registering the run", detail="no answer in time") from exc
        run_log.registered = True
        await self._index.add([run_log])

    async def claim(self, owner: str, key: str, fingerprint: str, run_log: RedisRunLog
                    ) -> Claim:
        """Claims ``key`` of ``owner`` for ``run_log``'s run, or finds the run that holds it.

        Raises:
            RequestError: Redis did not answer before the call's deadline (UNAVAILABLE), or
                the key stayed contended.
        """
        shared = self._shared
        claim_key = shared.keys.claim(owner, key)
        mine = json.dumps({"fp": fingerprint, "run": run_log.run_id})
        # Redis's clock decides whether the claim came too late (see scripts.CLAIM); the
        # call gives up at the same moment by this process's clock.
        try:
            # The call's deadline outside reachable(), which reports a timeout of redis-py's
            # as Redis unreachable: this one (or a claim Redis found late) is told as such.
            async with asyncio.timeout(max(0.0, run_log.deadline - time.monotonic())):
                with reachable("claiming the idempotency key"):
                    while True:
                        try:
                            claim = await self._claim(run_log, claim_key, fingerprint, mine)
                            break
                        except SLOT_MOVING:
                            # The run's slot or the claim's is being moved (TRYAGAIN until
                            # its keys are all on one node): every step of a claim is safe
                            # to repeat, so try again until the call's deadline.
                            await asyncio.sleep(SLOT_MOVING_RETRY_SECONDS)
        except (Unavailable, TimeoutError, ClaimTooLate) as exc:
            # Redis may apply the claim after this call gave up (it stalled, or the reply
            # was lost): undo it in the background once it no longer can.
            self._abandoned[run_log.run_id] = (claim_key, mine,
                                               shared.deadline_ms(run_log.deadline))
            if isinstance(exc, Unavailable):
                raise
            raise request_error(exc, "claiming the idempotency key") from exc
        if claim.won:
            # Past the call's deadline, best effort (bounded by the store's timeout): the key
            # is claimed, whatever the nodes of the indexes (other slots) do meanwhile.
            await self._index.add([run_log])
        return claim

    async def _claim(self, run_log: RedisRunLog, claim_key: str, fingerprint: str, mine: str
                     ) -> Claim:
        shared = self._shared
        scripts = shared.scripts
        # What the key must hold for this run to take it: nothing, or a lost or expired run.
        expected: bytes | str = ""
        for _ in range(10):
            register = [shared.token(run_log.run_id), shared.lease_ms, shared.running_ttl_ms,
                        run_log.owner, run_log.tool, shared.replica]
            reply: Any
            # A run registered here enters the sweep's set in the same round trip (see
            # RunIndex.sweep_commands): its replica may die before the next.
            if not shared.cluster:  # one script: the claim and its run, atomically
                reply = await scripts.call(scripts.claim, shared.with_claim(
                    shared.run_keys(run_log.run_id), claim_key),
                    [*register, expected, mine, shared.deadline_ms(run_log.deadline)],
                    before=self._index.sweep_commands([run_log]))
            elif not run_log.registered:  # two steps, the run first (see scripts.REGISTER_RUN)
                reply = await scripts.call(scripts.register_run, shared.run_keys(run_log.run_id),
                                           [*register, shared.deadline_ms(run_log.deadline)],
                                           before=self._index.sweep_commands([run_log]))
                if reply[0] == 1:
                    run_log.registered = True
                    continue
            else:
                reply = await scripts.call(scripts.claim_key, [claim_key], [
                    expected, mine, shared.deadline_ms(run_log.deadline), shared.running_ttl_ms])
            if reply[0] == 1:  # claimed, and the run registered with it
                run_log.claim_key = claim_key
                run_log.claim_value = mine
                run_log.registered = True
                return Claim(run_log.run_id, fingerprint, won=True)
            if reply[0] == -2:
                # Not late when Redis's clock is ahead of this host's: count with it from
                # now on.
                if time.monotonic() >= run_log.deadline or \
                        not shared.clock_ran_ahead(int(reply[1])):
                    raise ClaimTooLate
                continue
            raw, expected = reply[1], ""
            if raw is None:
                continue  # expired in between; try again
            held = json.loads(raw)
            if held["fp"] != fingerprint:
                return Claim(held["run"], held["fp"], won=False)
            state = await self._leases.state(held["run"])
            if state == "orphaned":
                # Its replica is lost only once its lease has stayed lapsed for a whole
                # lease; until then follow the run, which is either resumed by its replica or
                # ended RUN_LOST (then a retry runs the tool).
                await self._leases.end_if_lost(held["run"])
                state = await self._leases.state(held["run"])
            if state in ("running", "finished", "orphaned"):
                return Claim(held["run"], held["fp"], won=False)
            # Lost, or expired: the key is free for this run, if nobody took it first.
            expected = raw
        raise Unavailable("the idempotency key is contended; retry", reason="CLAIM_CONTENDED",
                          retry_after=RETRY_AFTER_SECONDS)

    async def undo_abandoned(self) -> None:
        """Undoes the claims whose calls gave up (see :data:`~stargrpc.stores.redis.scripts.
        ABANDON`), in one round trip; a failure is logged and tried again next time."""
        if not self._abandoned:
            return
        try:
            await self._undo_abandoned()
        except RedisError as exc:
            log.warning("redis_abandoned_claims_not_undone", error=str(exc))

    async def _undo_abandoned(self) -> None:
        shared = self._shared
        scripts = shared.scripts
        # Taken now: calls giving up meanwhile add to it while these round trips wait.
        abandoned = list(self._abandoned.items())
        calls = [(shared.with_claim(shared.run_keys(run_id), claim_key),
                  [mine, deadline_ms, shared.token(run_id),
                   error_result(run_id, 1, "RUN_LOST", _ABANDONED_MESSAGE),
                   shared.retention_ms])
                 for run_id, (claim_key, mine, deadline_ms) in abandoned]
        replies = await scripts.call_all(scripts.abandon, calls, durable=True)
        if shared.cluster:  # the claims live in other slots: their half, in the same way
            claims = await scripts.call_all(scripts.abandon_claim, [
                ([claim_key], [mine, deadline_ms])
                for _, (claim_key, mine, deadline_ms) in abandoned], durable=True)
            replies = [1 if (run, claim) == (1, 1) else 0
                       for run, claim in zip(replies, claims, strict=True)]
        for (run_id, _), reply in zip(abandoned, replies, strict=True):
            if reply == 1:
                self._abandoned.pop(run_id, None)
