"""Sends each Result to its delivery target when the run ends, at least once.

Each delivery is a task: it waits for the run's Result (from the run itself, or from its log
on any replica), then sends it — a signed HTTPS POST (:mod:`stargrpc.delivery.signing`) or
an ``XADD`` to a Redis stream — retrying with exponential backoff
(``delivery_retry_initial_seconds`` doubling up to ``delivery_retry_max_interval_seconds``)
until it is taken or ``delivery_retry_seconds`` have passed. Every attempt and the final
state are counted (``tool_executor_delivery_attempts``, ``tool_executor_deliveries``) and
logged.

A delivery is made durable before the call that asked for it is answered
(:meth:`Deliveries.register`, awaited by the runtime before the run starts): a call that
was answered has a delivery that survives the process.

In a fleet the run is registered in Redis first (its lease and meta hash, as a claim
registers it, rather than with its first events), then the delivery: pending deliveries
live in Redis (``delivery:pending``, a hash of run id → target) with a lease per delivery
(``delivery:{run_id}:lease``) that the replica working on it renews. A replica that dies
leaves its deliveries pending: once a lease lapses another replica takes it over, reads the
Result from the run's log (a run lost with its replica ends ``RUN_LOST``, and that Result is
delivered) and sends it again — hence at least once: receivers de-duplicate by run id.

A lone server keeps its pending deliveries in the state folder instead
(:mod:`stargrpc.delivery.journal`, committed before the call is answered); after a restart
it delivers them: the Result when the run had ended, else ``Result{ERROR, RUN_LOST}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
from collections.abc import Callable
from typing import Any

import httpx
import structlog
from google.protobuf import json_format
from google.protobuf.message import DecodeError

from stargrpc import metrics
from stargrpc.delivery.journal import JOURNAL_NAME, DeliveryJournal
from stargrpc.delivery.signing import SIGNATURE_HEADER, sign
from stargrpc.delivery.target import DeliveryTarget, delivery_policy
from stargrpc.egress import vet_url
from stargrpc.errors import Unavailable
from stargrpc.settings import Settings
from stargrpc.stores.base import RunLog, RunStore
from stargrpc.stores.keys import is_reserved_key
from stargrpc.v1 import events_pb2

log = structlog.get_logger("stargrpc.delivery")


class DeliveryFailed(Exception):
    """One attempt did not deliver; the message says why."""


class Deliveries:
    """The deliveries of one server.

    Attributes:
        settings: The server's settings.
        store: The run store, whose Redis (in a fleet) keeps the pending deliveries.
    """

    settings: Settings
    store: RunStore
    _redis: Any
    _prefix: str
    _replica: str
    _lease_ms: int
    _active: dict[str, asyncio.Task[None]]
    _recovery: asyncio.Task[None] | None
    _key: bytes | None
    _journal: DeliveryJournal | None
    #: Told the final state of each delivery (the audit trail records it): run id, tool,
    #: target, "delivered" or "failed", attempts made, why it failed ("" when delivered).
    on_final: Callable[[str, str, DeliveryTarget, str, int, str], None] | None

    def __init__(self, settings: Settings, store: RunStore) -> None:
        self.settings = settings
        self.store = store
        self._redis = getattr(store, "redis", None)
        self._prefix = settings.redis_key_prefix
        self._replica = str(getattr(store, "replica", "local"))
        self._lease_ms = int(settings.run_lease_seconds * 1000)
        self._active = {}
        self._recovery = None
        self._key = None
        self._journal = None if self.fleet else DeliveryJournal(settings.state_dir
                                                                 / JOURNAL_NAME)
        self.on_final = None

    @property
    def fleet(self) -> bool:
        """Whether pending deliveries live in Redis (and Redis streams can be targets)."""
        return self._redis is not None

    def start(self) -> None:
        """Starts taking over the deliveries other replicas left (in a fleet), or those a
        process that died left in the state folder (alone)."""
        if self._recovery is None:
            self._recovery = asyncio.create_task(
                self._recover_loop() if self.fleet else self._resume_journal(),
                name="deliveries")

    async def aclose(self, grace: float = 0.0) -> None:
        """Waits up to ``grace`` seconds for the deliveries under way, then stops them; in a
        fleet, what is not delivered stays pending for another replica."""
        if self._active and grace > 0:
            await asyncio.wait(list(self._active.values()), timeout=grace)
        tasks = list(self._active.values())
        if self._recovery is not None:
            tasks.append(self._recovery)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._journal is not None:
            await asyncio.to_thread(self._journal.close)

    async def register(self, run_log: RunLog, tool: str, target: DeliveryTarget) -> None:
        """Makes the delivery of the Result of ``run_log``'s run durable, before the run starts
        and its call is answered: in a fleet the run is registered in Redis, then the
        delivery; alone the delivery is committed to the state folder's journal.

        Raises:
            Unavailable: Redis, or the state folder, cannot keep it (the run must not
                start: nobody would deliver its Result).
        """
        if self.fleet:
            await self.store.register(run_log)
            try:
                async with asyncio.timeout(self.settings.redis_timeout_seconds):
                    await self._register(run_log.run_id, tool, target)
            except Exception as exc:
                log.warning("delivery_not_registered", run_id=run_log.run_id, kind=target.kind,
                            error=f"{type(exc).__name__}: {exc}"[:300])
                # Its run will not start: a half-written delivery must not be taken over.
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(self.settings.redis_timeout_seconds):
                        await self._redis.hdel(self._pending_key(), run_log.run_id)
                raise Unavailable("the shared run store (Redis) could not keep the "
                                  "delivery; retry shortly", reason="RUN_STORE_UNAVAILABLE",
                                  retry_after=1.0) from exc
            return
        assert self._journal is not None
        try:
            await asyncio.to_thread(self._journal.add, run_log.run_id, tool, target)
        except Exception as exc:  # sqlite3.Error, OSError: the folder cannot take it
            log.error("delivery_not_registered", run_id=run_log.run_id, kind=target.kind,
                      path=str(self._journal.path), error=str(exc))
            raise Unavailable("the server could not keep the delivery in its state "
                              "folder; retry shortly", retry_after=1.0) from exc

    def track(self, run_id: str, tool: str, target: DeliveryTarget) -> None:
        """Delivers the Result of ``run_id`` to ``target`` when the run ends (its delivery
        was made durable by :meth:`register`)."""
        if run_id not in self._active:
            self._spawn(run_id, tool, target)

    def _spawn(self, run_id: str, tool: str, target: DeliveryTarget,
               result: events_pb2.Result | None = None) -> None:
        task = asyncio.create_task(self._deliver_run(run_id, tool, target, result),
                                   name=f"delivery-{run_id}")
        self._active[run_id] = task
        task.add_done_callback(lambda _: self._active.pop(run_id, None))

    # -- one delivery ----------------------------------------------------------------------

    def _pending_key(self) -> str:
        return f"{self._prefix}delivery:pending"

    def _lease_key(self, run_id: str) -> str:
        return f"{self._prefix}delivery:{run_id}:lease"

    async def _deliver_run(self, run_id: str, tool: str, target: DeliveryTarget,
                           result: events_pb2.Result | None) -> None:
        renewer = None
        try:
            if self.fleet:
                renewer = asyncio.create_task(self._renew(run_id))
            if result is None:
                result = await self._result_of(run_id)
                if result is not None and self._journal is not None:
                    await self._keep_result(run_id, result)
            if result is None:
                log.error("delivery_failed", run_id=run_id, kind=target.kind,
                          reason="the run expired before its Result could be read")
                metrics.DELIVERIES.labels(target.kind, "failed").inc()
                self._final(run_id, tool, target, "failed", 0,
                            "the run expired before its Result could be read")
            else:
                await self._send_with_retries(run_id, tool, target, result)
            if self.fleet:
                await self._redis.hdel(self._pending_key(), run_id)
                await self._redis.delete(self._lease_key(run_id))
            elif self._journal is not None:
                await asyncio.to_thread(self._journal.remove, run_id)
        except asyncio.CancelledError:
            raise
        except Exception:  # Redis went away, say: another replica (or a restart) takes it over
            log.exception("delivery_interrupted", run_id=run_id, kind=target.kind)
        finally:
            if renewer is not None:
                renewer.cancel()

    async def _keep_result(self, run_id: str, result: events_pb2.Result) -> None:
        """Keeps the Result in the journal: a restart from now on delivers it, not RUN_LOST.
        Best effort: the delivery goes on without it."""
        assert self._journal is not None
        try:
            await asyncio.to_thread(self._journal.set_result, run_id,
                                    result.SerializeToString())
        except Exception as exc:
            log.warning("delivery_result_not_kept", run_id=run_id,
                        path=str(self._journal.path), error=str(exc))

    async def _register(self, run_id: str, tool: str, target: DeliveryTarget) -> None:
        record = json.dumps({"tool": tool, "target": target.to_json()})
        # Two keys in two slots of a cluster, so no transaction (a cluster refuses one that
        # spans slots): both are written before the call is answered, so a crash in between
        # loses no promised delivery; a pending delivery whose lease was lost is taken over
        # by another replica too (at least once).
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.set(self._lease_key(run_id), self._replica, px=self._lease_ms)
            pipe.hset(self._pending_key(), run_id, record)
            await pipe.execute()

    async def _renew(self, run_id: str) -> None:
        while True:
            await asyncio.sleep(self._lease_ms / 3000)
            with contextlib.suppress(Exception):
                await self._redis.set(self._lease_key(run_id), self._replica,
                                      px=self._lease_ms)

    async def _result_of(self, run_id: str) -> events_pb2.Result | None:
        run_log = await self.store.open(run_id)
        # A run reaches Redis with its first events, a moment after it started: a delivery
        # taken over from a replica that died then may look for it a little early.
        for _ in range(20):
            if run_log is not None:
                break
            await asyncio.sleep(self._lease_ms / 10_000)
            run_log = await self.store.open(run_id)
        if run_log is None:
            return None
        async for event in run_log.follow(max(0, run_log.last_seq - 1)):
            if event.HasField("result"):
                return event.result
        return None

    async def _send_with_retries(self, run_id: str, tool: str, target: DeliveryTarget,
                                 result: events_pb2.Result) -> bool:
        settings = self.settings
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + settings.delivery_retry_seconds
        wait = settings.delivery_retry_initial_seconds
        attempt = 0
        reason = ""
        while True:
            attempt += 1
            try:
                async with asyncio.timeout(settings.delivery_timeout_seconds):
                    await self._send(run_id, tool, target, result)
            except Exception as exc:
                metrics.DELIVERY_ATTEMPTS.labels(target.kind, "failed").inc()
                reason = f"{type(exc).__name__}: {exc}"[:500]
                log.warning("delivery_attempt_failed", run_id=run_id, kind=target.kind,
                            attempt=attempt, error=reason)
            else:
                metrics.DELIVERY_ATTEMPTS.labels(target.kind, "ok").inc()
                metrics.DELIVERIES.labels(target.kind, "delivered").inc()
                log.info("delivered", run_id=run_id, kind=target.kind, attempts=attempt)
                self._final(run_id, tool, target, "delivered", attempt, "")
                return True
            if loop.time() + wait > give_up_at:
                break
            await asyncio.sleep(wait)
            wait = min(wait * 2, settings.delivery_retry_max_interval_seconds)
        metrics.DELIVERIES.labels(target.kind, "failed").inc()
        log.error("delivery_failed", run_id=run_id, kind=target.kind, attempts=attempt,
                  error=reason)
        self._final(run_id, tool, target, "failed", attempt, reason)
        return False

    def _final(self, run_id: str, tool: str, target: DeliveryTarget, state: str,
               attempts: int, reason: str) -> None:
        if self.on_final is not None:
            try:
                self.on_final(run_id, tool, target, state, attempts, reason)
            except Exception:  # the audit's trouble must not undo a delivery
                log.exception("delivery_audit_failed", run_id=run_id)

    async def _send(self, run_id: str, tool: str, target: DeliveryTarget,
                    result: events_pb2.Result) -> None:
        result_json = json_format.MessageToDict(result)
        if target.kind == "redis_stream":
            if is_reserved_key(target.address):  # kept by a version that did not refuse it
                raise DeliveryFailed("the stream name is one of the run store's keys")
            await self._redis.xadd(f"{self._prefix}{target.address}", {
                "run_id": run_id, "tool_name": tool,
                "outcome": events_pb2.Outcome.Name(result.outcome),
                "result": json.dumps(result_json)},
                maxlen=self.settings.delivery_redis_stream_maxlen or None, approximate=False)
            return
        body = json.dumps({"run_id": run_id, "tool_name": tool, "result": result_json}
                          ).encode()
        # Vetted again at each attempt: what the name resolves to may have changed.
        vetted = await vet_url(target.address, delivery_policy(self.settings))
        headers = {SIGNATURE_HEADER: sign(self._signing_key(), body, int(time.time())),
                   "stargrpc-run-id": run_id, "content-type": "application/json",
                   "host": vetted.host_header}
        # Streamed, and its body never read: only the status counts, and a body (a
        # compression bomb, an endless one) is the receiver's to send, not ours to hold.
        async with httpx.AsyncClient(verify=self._tls(), trust_env=False,
                                     follow_redirects=False,
                                     timeout=self.settings.delivery_timeout_seconds
                                     ) as client, client.stream(
                "POST", vetted.request_url, content=body, headers=headers,
                extensions=vetted.extensions) as response:
            status = response.status_code
        if not 200 <= status < 300:
            raise DeliveryFailed(f"the receiver answered HTTP {status}")

    def _signing_key(self) -> bytes:
        if self._key is None:
            path = self.settings.delivery_webhook_secret_file
            if path is None:
                raise DeliveryFailed("delivery_webhook_secret_file is not set")
            self._key = path.read_bytes().strip()
        return self._key

    def _tls(self) -> ssl.SSLContext:
        ca_file = self.settings.delivery_ca_file
        return ssl.create_default_context(cafile=str(ca_file) if ca_file else None)

    # -- taking over -----------------------------------------------------------------------

    async def _recover_loop(self) -> None:
        while True:
            await asyncio.sleep(self._lease_ms / 2000)
            try:
                await self._take_over()
            except Exception as exc:
                log.warning("deliveries_not_taken_over", error=str(exc))

    async def _take_over(self) -> None:
        pending = await self._redis.hgetall(self._pending_key())
        for raw_id, raw in pending.items():
            run_id = raw_id.decode()
            if run_id in self._active:
                continue
            if not await self._redis.set(self._lease_key(run_id), self._replica,
                                         px=self._lease_ms, nx=True):
                continue  # another replica is on it
            try:
                record = json.loads(raw)
                target = DeliveryTarget.from_json(record["target"])
            except (ValueError, KeyError, TypeError):
                log.error("delivery_record_unreadable", run_id=run_id)
                await self._redis.hdel(self._pending_key(), run_id)
                continue
            log.info("delivery_taken_over", run_id=run_id, kind=target.kind)
            self._spawn(run_id, str(record.get("tool", "")), target)

    async def _resume_journal(self) -> None:
        """Delivers what a process that died left in the journal (a lone server)."""
        assert self._journal is not None
        try:
            left = await asyncio.to_thread(self._journal.left_behind)
        except Exception as exc:
            log.error("deliveries_not_resumed", path=str(self._journal.path), error=str(exc))
            return
        for pending in left:
            if pending.run_id in self._active:
                continue
            result = None
            if pending.result is not None:
                try:
                    result = events_pb2.Result.FromString(pending.result)
                except DecodeError:  # a damaged row: what is known is that the run ended
                    log.error("delivery_result_unreadable", run_id=pending.run_id)
            if result is None:  # its run died with the process, unfinished
                result = events_pb2.Result(outcome=events_pb2.OUTCOME_ERROR)
                result.error.code = "RUN_LOST"
                result.error.message = ("the server stopped before the run ended; run it "
                                        "again")
            log.info("delivery_resumed", run_id=pending.run_id, kind=pending.target.kind,
                     outcome=events_pb2.Outcome.Name(result.outcome))
            self._spawn(pending.run_id, pending.tool, pending.target, result)
