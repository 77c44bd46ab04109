"""The runtime: the current catalog, the runs in flight and how a run is started.

It owns everything between a decoded request and a running :class:`~stargrpc.run.Run`:
tool lookup, the catalog-hash check, argument validation, the permission check and the
run's event log. It knows nothing of protobuf requests; ``service.py`` maps those.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog

from stargrpc import metrics
from stargrpc.arguments import ArgumentLimits, validate
from stargrpc.calls import current_call
from stargrpc.errors import (
    CatalogStale,
    FieldViolation,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from stargrpc.idempotency import MAX_KEY_LENGTH, check_reuse, fingerprint
from stargrpc.limits import ConcurrencyLimits
from stargrpc.outcome import Outcome
from stargrpc.permissions import AllowAll, ToolPolicy
from stargrpc.principal import Principal
from stargrpc.registry import Registry, ToolSpec
from stargrpc.run import Run
from stargrpc.runlog import MemoryRunStore, RunLog, RunStore
from stargrpc.settings import Settings
from stargrpc.v1 import events_pb2

log = structlog.get_logger("stargrpc.runtime")


@dataclass(frozen=True)
class ExecuteCall:
    """A decoded Execute request."""

    tool_name: str
    arguments: dict[str, Any]
    catalog_hash: str = ""
    idempotency_key: str = ""
    invocation: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Submission:
    """What an Execute reads: the run's log, and the run itself when this call started it.

    Attributes:
        log: The event log to stream from seq 1.
        run: The run this call started; None when it attached to (or replays) the run that
            already holds the idempotency key.
    """

    log: RunLog
    run: Run | None


#: The metric series each run touches when it ends, by tool and outcome: looking a labelled
#: series up is a lock and several dictionary lookups, on every run.
_FINISHED_SERIES: dict[tuple[str, int], tuple[Any, Any]] = {}


def _count_finished(run: Run) -> None:
    assert run.result is not None
    metrics.RUNS_IN_FLIGHT.dec()
    key = (run.spec.name, run.result.outcome)
    series = _FINISHED_SERIES.get(key)
    if series is None:
        outcome = events_pb2.Outcome.Name(key[1]).removeprefix("OUTCOME_").lower()
        series = (metrics.TASKS_TOTAL.labels(key[0], outcome),
                  metrics.DURATION_SECONDS.labels(key[0]))
        _FINISHED_SERIES[key] = series
    series[0].inc()
    series[1].observe(run.result.duration.ToNanoseconds() / 1e9)


class Runtime:
    """Starts runs and keeps track of them.

    Attributes:
        settings: The server's settings (tools read them through ``ctx.settings``).
        store: Where run event logs live.
        policy: Who may run which tool.
        limits: Bounds on arguments.
        concurrency: Bounds on runs in flight.
        runs: Runs in flight in this process, by id.
        draining: Set during shutdown; new runs are refused with UNAVAILABLE.
    """

    settings: Settings
    store: RunStore
    policy: ToolPolicy
    limits: ArgumentLimits
    concurrency: ConcurrencyLimits
    runs: dict[str, Run]
    draining: bool
    launch_hooks: list[Callable[[Run], None]]
    _registry: Registry
    _catalog_changed: asyncio.Event

    def __init__(self, registry: Registry, *, store: RunStore | None = None,
                 policy: ToolPolicy | None = None, limits: ArgumentLimits | None = None,
                 settings: Settings | None = None,
                 concurrency: ConcurrencyLimits | None = None) -> None:
        self._registry = registry
        self.settings = settings if settings is not None else Settings()
        self.store = store if store is not None else MemoryRunStore()
        self.policy = policy if policy is not None else AllowAll()
        self.limits = limits or ArgumentLimits()
        self.concurrency = concurrency or ConcurrencyLimits()
        self.runs = {}
        # CancelRun and a shared store's remote cancels reach runs of this process here.
        self.store.cancel_handler = self.cancel_local
        self.store.steer_handler = self.steer_local
        self.draining = False
        # Called with each run just before it starts: supervisors attach here, metrics count.
        self.launch_hooks = []
        self._catalog_changed = asyncio.Event()

    # -- catalog ---------------------------------------------------------------------------

    @property
    def registry(self) -> Registry:
        """The current catalog."""
        return self._registry

    def replace_registry(self, registry: Registry) -> bool:
        """Swaps in a new catalog (after a reload) and wakes catalog watchers.

        Returns:
            Whether the catalog hash changed.
        """
        changed = registry.catalog_hash != self._registry.catalog_hash
        self._registry = registry
        if changed:
            wakeup, self._catalog_changed = self._catalog_changed, asyncio.Event()
            wakeup.set()
            log.info("catalog_changed", catalog_hash=registry.catalog_hash, tools=len(registry))
        return changed

    async def catalog_updates(self, known_hash: str = "") -> AsyncIterator[Registry]:
        """The current catalog (unless its hash is ``known_hash``), then each new one."""
        last = known_hash
        while True:
            registry = self._registry
            if registry.catalog_hash != last:
                last = registry.catalog_hash
                yield registry
                continue
            await self._catalog_changed.wait()

    def lookup(self, tool_name: str) -> ToolSpec:
        """The tool named ``tool_name``.

        Raises:
            InvalidArgument: The name is empty.
            NotFound: No such tool.
        """
        if not tool_name:
            raise InvalidArgument("tool_name is required",
                                  [FieldViolation("tool_name", "must not be empty")])
        spec = self._registry.get(tool_name)
        if spec is None:
            shown = tool_name if len(tool_name) <= 64 else tool_name[:64] + "…"
            raise NotFound(f"unknown tool {shown!r}", reason="TOOL_NOT_FOUND",
                           metadata={"tool_name": shown})
        return spec

    # -- runs ------------------------------------------------------------------------------

    def prepare(self, call: ExecuteCall, principal: Principal) -> Run:
        """Checks a call and builds its run, without starting it.

        Raises:
            RequestError: Any reason to refuse the call before it runs.
        """
        if self.draining:
            raise Unavailable("the server is shutting down; retry on another replica",
                              reason="DRAINING")
        spec = self.lookup(call.tool_name)
        if call.catalog_hash and call.catalog_hash != self._registry.catalog_hash:
            raise CatalogStale(
                "the catalog has changed since the caller loaded it; reload it with ListTools",
                metadata={"current_catalog_hash": self._registry.catalog_hash,
                          "given_catalog_hash": call.catalog_hash[:80]})
        record = current_call.get()
        if record is not None:
            record.tool = spec.name
            record.privileged = spec.privileged
            record.idempotency_key = call.idempotency_key
            record.arguments = call.arguments
        # Identity fields in the request count only for callers that may act for others.
        principal = self.policy.delegate(principal, call.invocation)
        if record is not None:
            record.principal = principal
        self.policy.check(principal, spec)
        args = validate(spec.args_model, call.arguments)
        run_id = uuid.uuid4().hex
        if record is not None:
            record.run_id = run_id
        return Run(run_id, spec, args, principal, call.invocation,
                   self.store.create(run_id, owner=principal.id, tool=spec.name),
                   settings=self.settings)

    def launch(self, run: Run) -> Run:
        """Starts a prepared run and tracks it until it ends."""
        self.runs[run.run_id] = run
        record = current_call.get()
        if record is not None:
            record.run = run
        for hook in self.launch_hooks:
            hook(run)
        metrics.RUNS_IN_FLIGHT.inc()
        run.finish_hooks.append(_count_finished)
        task = run.start()
        task.add_done_callback(lambda _: self.runs.pop(run.run_id, None))
        return run

    async def submit(self, call: ExecuteCall, principal: Principal) -> Submission:
        """Checks a call, then starts its run — or, when its idempotency key is already
        held, returns the log of the run that holds it (attach while it runs, replay after).

        Raises:
            RequestError: Any reason to refuse the call before it runs, including a key
                reused for another tool or arguments, a concurrency limit, or a shared
                store that cannot be reached.
        """
        key = call.idempotency_key
        if len(key) > MAX_KEY_LENGTH:
            raise InvalidArgument("idempotency_key is too long", [FieldViolation(
                "idempotency_key", f"at most {MAX_KEY_LENGTH} characters")])
        run = self.prepare(call, principal)
        # Reserve a place first so that a refused call leaves no claim behind; a call that
        # turns out to attach gives its place back at once.
        try:
            permit = self.concurrency.acquire(principal.id, run.spec.name)
        except ResourceExhausted:
            await self.store.discard(run.log)
            raise
        try:
            await self.store.publish(run.log)
            if key:
                wanted = fingerprint(run.spec.name, call.arguments)
                claim = await self.store.claim(principal.id, key, wanted, run.log)
                if not claim.won:
                    await self.store.discard(run.log)
                    check_reuse(key, claim.fingerprint, wanted, claim.run_id)
                    held = await self.store.open(claim.run_id)
                    if held is None:  # expired between the claim and now
                        raise Unavailable("the run holding this idempotency key just expired; "
                                          "retry", reason="IDEMPOTENT_RUN_EXPIRED")
                    record = current_call.get()
                    if record is not None:
                        record.run_id = claim.run_id
                        record.extra["idempotent"] = "replayed" if held.finished else "attached"
                    permit.release()
                    return Submission(log=held, run=None)
        except BaseException:
            permit.release()
            # The run never started: forget its log too (best effort — the store may be
            # the very thing that failed), so a refused call leaves nothing behind.
            with contextlib.suppress(Exception):
                await self.store.discard(run.log)
            raise
        run.finish_hooks.append(lambda _: permit.release())
        return Submission(log=run.log, run=self.launch(run))

    def cancel_local(self, run_id: str, reason: str, failure_code: str = "") -> bool:
        """Stops a run of this process with Result{CANCELLED}, or Result{ERROR,
        failure_code} when the run store cannot keep it (``RUN_LOST``, ``STORE_CONFLICT``).

        Returns:
            Whether the run was still going.
        """
        run = self.runs.get(run_id)
        if failure_code:
            return run is not None and run.stop(Outcome.ERROR, failure_code, reason)
        return run is not None and run.stop(Outcome.CANCELLED, "CANCELLED", reason)

    def steer_local(self, run_id: str, message: str, source: str) -> bool:
        """Steers a run of this process (see :meth:`Run.steer`, whose refusals it raises).

        Returns:
            False when no such run is going in this process.
        """
        run = self.runs.get(run_id)
        if run is None:
            return False
        run.steer(message, source=source)
        return True

    def get(self, run_id: str) -> Run | None:
        """A run in flight in this process."""
        return self.runs.get(run_id)

    async def drain(self, grace: float) -> None:
        """Refuses new runs, waits up to ``grace`` seconds for runs in flight, then cancels
        what is left (each still ends with its Result)."""
        self.draining = True
        tasks = [run.start() for run in self.runs.values()]
        if tasks:
            log.info("draining", runs=len(tasks), grace_seconds=grace)
            _, pending = await asyncio.wait(tasks, timeout=grace)
            for run in list(self.runs.values()):
                run.stop(Outcome.CANCELLED, "SERVER_SHUTDOWN", "the server is shutting down")
            if pending:
                await asyncio.wait(pending, timeout=5)
