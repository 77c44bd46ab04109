"""The runtime: the current catalog, the runs in flight and how a run is started.

It owns everything between a decoded request and a running :class:`~stargrpc.runs.run.Run`:
tool lookup, the catalog-hash check, argument validation, the permission check and the
run's event log. It knows nothing of protobuf requests; ``service.py`` maps those.

**The run pipeline.** Every run any entry point admits (gRPC Execute, the HTTP gateway and
the MCP endpoint through it, :func:`stargrpc.testing.run_tool`) is started through one chain
of :class:`RunInterceptor` objects over a :class:`RunInput` — Temporal's inbound
interceptors: each holds ``next`` and delegates by default, so a field added to the input
breaks nobody. Outermost first: the embedder's interceptors (tracing, when on), then
**supervision** (:class:`SupervisionInterceptor`, which the runtime always inserts: a run
cannot start without its critic), then the start of the run's task.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog
from pydantic import BaseModel

from stargrpc import metrics
from stargrpc.audit.record import outcome_for_status, utc_now
from stargrpc.critic.loading import Critics
from stargrpc.critic.supervision import Supervision, SupervisionPolicy
from stargrpc.errors import (
    CatalogStale,
    FailedPrecondition,
    FieldViolation,
    InvalidArgument,
    NotFound,
    RequestError,
    ResourceExhausted,
    Unavailable,
    reason_name,
)
from stargrpc.ids import new_id
from stargrpc.principal import Principal
from stargrpc.registry import NoArguments, Registry, ToolSpec
from stargrpc.runs.approval import ApprovalGate, Approvals
from stargrpc.runs.arguments import ArgumentLimits, validate
from stargrpc.runs.call_record import CallRecord, current_call
from stargrpc.runs.concurrency import ConcurrencyLimits
from stargrpc.runs.idempotency import MAX_KEY_LENGTH, check_reuse, fingerprint
from stargrpc.runs.lanes import (
    LaneBoard,
    LaneGate,
    LanePlace,
    LanePolicy,
    LaneTicket,
    LocalLanes,
)
from stargrpc.runs.outcome import Outcome
from stargrpc.runs.permissions import AllowAll, RunAccess, ToolPolicy
from stargrpc.runs.run import Run, RunLimits
from stargrpc.runs.trees import (
    CHILD_METHOD,
    MAX_RUN_ID_CHARS,
    PARENT_RUN_CANCELLED,
    PARENT_RUN_ENDED,
    RUN_TREE_FULL,
    CallTree,
    ChildAuditor,
    ChildResult,
    ChildRunError,
    ChildRunRefused,
    Relay,
    TreeLink,
    check_caps,
    check_parent_id,
    child_result,
    link_under,
    uncount,
)
from stargrpc.settings import Settings
from stargrpc.stores.approvals import MemoryApprovalStore
from stargrpc.stores.base import RunLog, RunStore, StateStore
from stargrpc.stores.memory import MemoryRunStore, MemoryStateStore
from stargrpc.v1 import errors_pb2, events_pb2

if TYPE_CHECKING:
    from stargrpc.runs.session_handle import RunSession

log = structlog.get_logger("stargrpc.runtime")

_RUN_NOT_FOUND = reason_name(errors_pb2.RUN_NOT_FOUND)


#: The arguments of every run of a tool without arguments called with none: one instance
#: serves them all, as it cannot be changed (frozen, no fields; a tool declaring
#: ``args: NoArguments`` is handed this very instance).
_NO_ARGUMENTS = NoArguments()


@dataclass(frozen=True)
class RunRequest:
    """What a caller asks the runtime to run, whatever the entry point (gRPC Execute or
    StartRun, the HTTP gateway and MCP through them, :mod:`stargrpc.testing`,
    :class:`~stargrpc.client.RemoteToolRegistry`)."""

    tool_name: str
    arguments: dict[str, Any]
    catalog_hash: str = ""
    idempotency_key: str = ""
    invocation: Mapping[str, Any] = field(default_factory=dict)
    #: How the run is supervised; None: the server's policy, without a caller deadline.
    policy: SupervisionPolicy | None = None
    #: A run of the caller's to hang the run under (checked: the caller must see it).
    parent_run_id: str = ""
    #: The priority asked for, passed on with the run (lanes read it).
    priority: int = 0
    #: The run of this process that asks for the run (``ctx.call``); never from a request.
    parent: Run | None = None
    #: The session the run runs in (``ctx.session``), found for the caller by the entry
    #: point (:meth:`stargrpc.sessions.Sessions.for_call`), or None.
    session: RunSession | None = None
    #: The lane to run in instead of the tool's (needs ``lane_override_role``).
    lane: str = ""
    #: Refuse (LANE_BUSY) when the estimated wait in the lane is longer; 0: wait.
    max_wait_seconds: float = 0.0


@dataclass(frozen=True)
class RunInput:
    """What the run pipeline starts.

    Attributes:
        run: The prepared run (not started).
        spec: Its tool.
        principal: Who started it.
        arguments: The call's arguments as given (a view: do not change it).
        policy: How it is supervised: the caller's deadline, the soft and hard timeouts.
        metadata: Anything an entry point wants the interceptors to see.
    """

    run: Run
    spec: ToolSpec
    principal: Principal
    arguments: Mapping[str, Any]
    policy: SupervisionPolicy
    metadata: Mapping[str, str] = field(default_factory=dict)


class RunInterceptor:
    """A stage of the run pipeline. Override :meth:`start` and call ``self.next.start``
    (the default does only that); the runtime sets ``next`` when it builds the chain.

    Attributes:
        next: The next stage inward.
    """

    next: RunInterceptor

    def start(self, input: RunInput) -> Run:
        """Starts ``input.run`` (by default: hands it to the next stage)."""
        return self.next.start(input)


class SupervisionInterceptor(RunInterceptor):
    """Puts each run under its critic (:mod:`stargrpc.critic.supervision`); always in the
    chain.

    Attributes:
        critics: The server's critic and the tools' own.
        verdict_timeout: The remote critic's verdict budget.
    """

    critics: Critics
    verdict_timeout: float

    def __init__(self, critics: Critics, verdict_timeout: float) -> None:
        self.critics = critics
        self.verdict_timeout = verdict_timeout

    def start(self, input: RunInput) -> Run:
        """Attaches the run's supervision, then starts it."""
        Supervision(input.run, input.policy, self.critics.for_tool(input.spec),
                    verdict_timeout=self.verdict_timeout).start()
        return self.next.start(input)


class _StartRun(RunInterceptor):
    """The innermost stage: tracks the run and starts its task."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime

    def start(self, input: RunInput) -> Run:
        run = input.run
        runs = self._runtime.runs
        runs[run.run_id] = run
        record = current_call.get()
        if record is not None:
            record.run = run
        metrics.RUNS_IN_FLIGHT.inc()
        run.finish_hooks.append(self._finished)
        run.finish_hooks.append(self._runtime.end_state)
        run.start(self._runtime.settings)
        return run

    def _finished(self, run: Run) -> None:
        # Once its Result is in the log the run is no longer in flight (a tool that ignored
        # its cancellation may still hold the run's task: it is not waited for).
        self._runtime.runs.pop(run.run_id, None)
        _count_finished(run)


@dataclass(frozen=True)
class Admission:
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
    assert run.result is not None and run.duration_ns is not None
    metrics.RUNS_IN_FLIGHT.dec()
    key = (run.spec.name, run.result.outcome)
    series = _FINISHED_SERIES.get(key)
    if series is None:
        outcome = events_pb2.Outcome.Name(key[1]).removeprefix("OUTCOME_").lower()
        series = (metrics.TASKS_TOTAL.labels(key[0], outcome),
                  metrics.DURATION_SECONDS.labels(key[0]))
        _FINISHED_SERIES[key] = series
    series[0].inc()
    series[1].observe(run.duration_ns / 1e9)  # the Result's duration, in seconds
    usage = run.result.usage
    if usage.HasField("cpu_user_seconds") or usage.HasField("peak_rss_bytes"):
        _observe_usage(run.spec.name, usage)


def _observe_usage(tool: str, usage: events_pb2.Usage) -> None:
    """Observes the measured figures of a run's receipt (a sandboxed run's, mostly)."""
    if usage.HasField("cpu_user_seconds") or usage.HasField("cpu_system_seconds"):
        metrics.RUN_CPU_SECONDS.labels(tool).observe(
            usage.cpu_user_seconds + usage.cpu_system_seconds)
    if usage.HasField("peak_rss_bytes"):
        metrics.RUN_PEAK_MEMORY_BYTES.labels(tool).observe(usage.peak_rss_bytes)


class Runtime:
    """Starts runs and keeps track of them.

    Attributes:
        settings: The server's settings (tools read them through ``ctx.settings``).
        store: Where run event logs live.
        state_store: Where tools keep run state (``ctx.state``): by default the run store's
            own (its ``state``), else one in memory.
        policy: Who may run which tool.
        run_access: Who may see and act on a run (watch, cancel, steer).
        limits: Bounds on arguments.
        run_limits: The limits every run keeps to, made once from :attr:`settings`.
        concurrency: Bounds on runs in flight (per replica: the hard ceiling, queued runs
            included).
        lane_policy: Which lane and priority each run gets.
        lanes: The lanes runs wait their turn in: the fleet's (the run store's ``lanes``)
            or this process's.
        runs: Runs in flight in this process, by id.
        draining: Set during shutdown; new runs are refused with UNAVAILABLE.
        critics: The server's critic and the tools' own.
        approvals: Which runs wait for a person's approval, and their requests: the run
            store's ``approvals`` (a fleet's), else this process's.
        audit_child: Writes the audit record of each child run a tool starts (``ctx.call``;
            set by the server from its audit interceptor); None: not audited here.
        trees: The call trees of this process whose parent runs elsewhere, by root id
            (each as long as a run of it lives here).
    """

    settings: Settings
    audit_child: ChildAuditor | None
    trees: weakref.WeakValueDictionary[str, CallTree]
    store: RunStore
    state_store: StateStore
    policy: ToolPolicy
    run_access: RunAccess
    limits: ArgumentLimits
    run_limits: RunLimits
    concurrency: ConcurrencyLimits
    lane_policy: LanePolicy
    lanes: LaneBoard
    runs: dict[str, Run]
    draining: bool
    critics: Critics
    approvals: Approvals
    _pipeline: RunInterceptor
    _interceptors: list[RunInterceptor]
    _registry: Registry
    _catalog_changed: asyncio.Event
    _state_endings: set[asyncio.Task[None]]
    _parent_watches: set[asyncio.Task[None]]

    def __init__(self, registry: Registry, *, store: RunStore | None = None,
                 policy: ToolPolicy | None = None, limits: ArgumentLimits | None = None,
                 settings: Settings | None = None,
                 concurrency: ConcurrencyLimits | None = None,
                 interceptors: Iterable[RunInterceptor] = (),
                 state_store: StateStore | None = None) -> None:
        """
        Raises:
            CriticConfigError: The server's critic or a tool's cannot be loaded.
        """
        self._registry = registry
        self.settings = settings if settings is not None else Settings()
        self.store = store if store is not None else MemoryRunStore()
        if state_store is None:
            state_store = getattr(self.store, "state", None) or MemoryStateStore()
        self.state_store = state_store
        self._state_endings = set()  # held until done, or the loop may drop them
        self._parent_watches = set()
        self.policy = policy if policy is not None else AllowAll()
        self.run_access = RunAccess.from_settings(self.settings)
        self.limits = limits or ArgumentLimits()
        self.run_limits = RunLimits.from_settings(self.settings)
        self.concurrency = concurrency or ConcurrencyLimits()
        self.lane_policy = LanePolicy(self.settings)
        self.lane_policy.check_tools(registry.values())
        # A fleet's store shares its lanes (lanes_for); one process keeps its own.
        fleet_lanes = getattr(self.store, "lanes_for", None)
        self.lanes = (fleet_lanes(self.lane_policy.limited) if fleet_lanes is not None
                      else LocalLanes(self.lane_policy.limited))
        self.runs = {}
        self.audit_child = None
        self.trees = weakref.WeakValueDictionary()
        # CancelRun and a shared store's remote cancels reach runs of this process here.
        self.store.cancel_handler = self.cancel_local
        self.store.steer_handler = self.steer_local
        self.draining = False
        self.critics = Critics(self.settings)
        self.critics.load_tools(registry.values())
        self.approvals = Approvals(self.settings, getattr(self.store, "approvals", None)
                                   or MemoryApprovalStore())
        self._interceptors = list(interceptors)
        self._pipeline = self._chain()
        self._catalog_changed = asyncio.Event()

    def end_state(self, run: Run) -> None:
        """Starts the retention (``state_retention_seconds``) of the run and tree state a
        finished run wrote, in the background."""
        scopes = run.state_scopes
        if not scopes:
            return
        # The tree's state outlives its other runs: it ends with the root.
        ending = [s for s in scopes if s.startswith("run:") or run.root_run_id == run.run_id]
        if ending:
            task = asyncio.create_task(self._end_state(ending))
            self._state_endings.add(task)
            task.add_done_callback(self._state_endings.discard)

    async def _end_state(self, scopes: list[str]) -> None:
        retention_ms = max(1, int(self.settings.state_retention_seconds * 1000))
        for scope in scopes:
            try:
                await self.state_store.end_scope(scope, retention_ms)
            except Exception:  # its running bound (runs/state.py) still ends it
                log.warning("run_state_end_failed", scope=scope, exc_info=True)

    # -- the run pipeline --------------------------------------------------------------------

    def _chain(self) -> RunInterceptor:
        stages = [*self._interceptors,
                  SupervisionInterceptor(self.critics,
                                         self.settings.critic_verdict_timeout_seconds)]
        inner: RunInterceptor = _StartRun(self)
        for stage in reversed(stages):
            stage.next = inner
            inner = stage
        return inner

    def add_interceptor(self, interceptor: RunInterceptor) -> None:
        """Adds a stage to the run pipeline, outermost (supervision stays innermost)."""
        self._interceptors.insert(0, interceptor)
        self._pipeline = self._chain()

    def _start(self, input: RunInput) -> Run:
        """Starts a prepared run through the run pipeline; it is tracked until it ends."""
        return self._pipeline.start(input)

    async def aclose(self) -> None:
        """Lets go of what the runtime holds open (a remote critic's channel, the approval
        store's poller)."""
        await self.critics.aclose()
        await self.approvals.store.aclose()

    # -- catalog ---------------------------------------------------------------------------

    @property
    def registry(self) -> Registry:
        """The current catalog."""
        return self._registry

    def replace_registry(self, registry: Registry) -> bool:
        """Swaps in a new catalog (after a reload) and wakes catalog watchers.

        Returns:
            Whether the catalog hash changed.

        Raises:
            CriticConfigError: A tool of the new catalog names a critic that cannot be
                loaded (the current catalog stays).
        """
        changed = registry.catalog_hash != self._registry.catalog_hash
        self.lane_policy.check_tools(registry.values())
        self.critics.load_tools(registry.values())
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

    def _prepare(self, request: RunRequest, principal: Principal,
                 link: TreeLink | None = None) -> Run:
        """Checks a request and builds its run, without starting it.

        Raises:
            RequestError: Any reason to refuse the request before it runs.
        """
        if self.draining:
            raise Unavailable("the server is shutting down; retry on another replica",
                              reason="DRAINING")
        spec = self.lookup(request.tool_name)
        if request.catalog_hash and request.catalog_hash != self._registry.catalog_hash:
            raise CatalogStale(
                "the catalog has changed since the caller loaded it; reload it with ListTools",
                metadata={"current_catalog_hash": self._registry.catalog_hash,
                          "given_catalog_hash": request.catalog_hash[:80]})
        record = current_call.get()
        if record is not None:
            record.tool = spec.name
            record.privileged = spec.privileged
            record.idempotency_key = request.idempotency_key
            record.arguments = request.arguments
        # Identity fields in the request count only for callers that may act for others.
        principal = self.policy.delegate(principal, request.invocation)
        if record is not None:
            record.principal = principal
        self.policy.check(principal, spec)
        choice = self.lane_policy.choose(spec, principal, lane=request.lane,
                                         priority=request.priority,
                                         max_wait=request.max_wait_seconds)
        args: BaseModel
        if spec.args_model is NoArguments and not request.arguments:
            args = _NO_ARGUMENTS  # what validating {} gives, made once
        else:
            args = validate(spec.args_model, request.arguments)
        run_id = new_id()
        if record is not None:
            record.run_id = run_id
        run_log = self.store.create(run_id, owner=principal.id, tool=spec.name)
        run = Run(run_id, spec, args, principal, request.invocation, run_log,
                  limits=self.run_limits)
        run.state_store = self.state_store
        run.runtime = self
        if link is not None:
            run.join_tree(link.parent_run_id, link.root_run_id, link.depth, link.tree)
            run_log.parent_run_id = link.parent_run_id
            run_log.root_run_id = link.root_run_id
            run_log.depth = link.depth
        if record is not None:
            record.root_run_id = run.root_run_id
            record.parent_run_id = run.parent_run_id
        if request.session is not None:
            run.session = request.session
        run.lane, run.priority = choice.lane, choice.priority
        run_log.lane, run_log.priority = choice.lane, choice.priority
        if record is not None and choice.capped:
            record.extra["priority"] = (f"asked {choice.asked_priority}, capped to "
                                        f"{choice.priority} (priority_max_per_principal)")
        return run

    async def admit(self, request: RunRequest, principal: Principal, *,
                    before_start: Callable[[Run], Awaitable[None]] | None = None
                    ) -> Admission:
        """Checks a request, then starts its run — or, when its idempotency key is already
        held, returns the log of the run that holds it (attach while it runs, replay after).

        Args:
            request: What to run.
            principal: Who asks.
            before_start: Awaited once the run holds its place in the store and before it
                starts, only for a run this call starts: what must be durable before the
                call is answered (a delivery of the run's Result). What it raises refuses
                the call, and the run is forgotten.

        Raises:
            RequestError: Any reason to refuse the request before it runs, including a key
                reused for another tool or arguments, a concurrency limit, or a shared
                store that cannot be reached.
        """
        key = request.idempotency_key
        if len(key) > MAX_KEY_LENGTH:
            raise InvalidArgument("idempotency_key is too long", [FieldViolation(
                "idempotency_key", f"at most {MAX_KEY_LENGTH} characters")])
        # Most runs hang under nothing: no coroutine for them.
        link = (await self._tree_link(request, principal)
                if request.parent is not None or request.parent_run_id else None)
        # The place in the tree is given back whatever refuses the call, and when it attaches
        # to another run; kept once this run starts.
        link_kept = False
        try:
            run = self._prepare(request, principal, link)
            # Reserve a place first so that a refused request leaves no claim behind; a
            # request that turns out to attach gives its place back at once.
            try:
                permit = self.concurrency.acquire(principal.id, run.spec.name)
            except ResourceExhausted:
                await self.store.discard(run.log)
                raise
            place: LanePlace | None = None
            ticket: LaneTicket | None = None
            gate: ApprovalGate | None = None
            try:
                await self.store.publish(run.log)
                if key:
                    wanted = fingerprint(run.spec.name, request.arguments,
                                         run.principal.acting_for)
                    claim = await self.store.claim(principal.id, key, wanted, run.log)
                    if not claim.won:
                        await self.store.discard(run.log)
                        check_reuse(key, claim.fingerprint, wanted, claim.run_id)
                        held = await self.store.open(claim.run_id)
                        if held is None:  # expired between the claim and now
                            raise Unavailable("the run holding this idempotency key just "
                                              "expired; retry",
                                              reason="IDEMPOTENT_RUN_EXPIRED")
                        record = current_call.get()
                        if record is not None:
                            record.run_id = claim.run_id
                            record.extra["idempotent"] = ("replayed" if held.finished
                                                          else "attached")
                        permit.release()
                        return Admission(log=held, run=None)
                if self.approvals.required(run.spec, run.principal):
                    # Written before the call is answered: an approver finds it at once.
                    gate = await self.approvals.request(run, request.arguments)
                ticket = self._lane_ticket(run, request, link)
                # A run that waits at an earlier gate (approval) enters its lane when it
                # gets there: a lane's slot is not held while a person decides.
                if ticket is not None and not run.gates and gate is None:
                    place = await self._enter_lane(ticket)
                if before_start is not None:
                    await before_start(run)
            except BaseException:
                if place is not None:
                    self.lanes.leave(place, ran=False)
                if gate is not None:  # refused after its request was written
                    await gate.withdraw("the call was refused before the run started")
                permit.release()
                # The run never started: forget its log too (best effort — the store may
                # be the very thing that failed), so a refused request leaves nothing.
                with contextlib.suppress(Exception):
                    await self.store.discard(run.log)
                raise
            link_kept = True
        finally:
            if link is not None and not link_kept:
                await self._give_back(link)
        run.finish_hooks.append(lambda _: permit.release())
        if gate is not None:  # approval first: a lane's slot is not held while a person decides
            run.gates = [gate, *(run.gates or [])]
        if ticket is not None:
            # After any gate already set (approval waits first, then the lane's queue).
            lane_gate = LaneGate(self.lanes, ticket, place, current_call.get())
            run.gates = [*(run.gates or ()), lane_gate]
            run.finish_hooks.append(lane_gate.leave)
        policy = request.policy or SupervisionPolicy.for_call(self.settings)
        started = self._start(RunInput(run=run, spec=run.spec, principal=run.principal,
                                       arguments=request.arguments, policy=policy))
        if link is not None and link.parent is not None:
            parent = link.parent
            assert isinstance(parent, Run)
            parent.adopt(started)
            if parent.finished or parent.stop_requested:  # it ended while this one started
                started.stop(Outcome.CANCELLED, PARENT_RUN_ENDED,
                             f"its parent run {parent.run_id} ended before it")
        elif link is not None:
            self._watch_remote_parent(started, link.parent_run_id)
        return Admission(log=run.log, run=started)

    # -- call trees (stargrpc.runs.trees) ------------------------------------------------------

    async def _tree_link(self, request: RunRequest, principal: Principal) -> TreeLink | None:
        """Where the requested run hangs in a call tree (None: a top-level run), its place
        in the tree counted.

        Raises:
            RequestError: The parent cannot be used, or a cap of the tree refuses the run.
        """
        record = current_call.get()
        if request.parent is not None:
            link = link_under(request.parent)
        elif request.parent_run_id:
            if record is not None:  # as named, for the record of a refusal (cut: unchecked)
                record.parent_run_id = request.parent_run_id[:MAX_RUN_ID_CHARS]
            link = await self._link_to(request.parent_run_id, principal)
        else:
            return None
        if record is not None:  # a refused child is recorded in its tree too
            record.parent_run_id, record.root_run_id = link.parent_run_id, link.root_run_id
        check_caps(link, self.settings)
        try:
            await self._count_in_fleet(link)
        except BaseException:
            uncount(link)
            raise
        return link

    async def _count_in_fleet(self, link: TreeLink) -> None:
        """Counts the run in its tree on every replica (a shared store's count: a tree an
        agent spreads over replicas keeps to ``max_runs_per_tree`` as a whole).

        Raises:
            ResourceExhausted: The tree has started ``max_runs_per_tree`` runs (RUN_TREE_FULL).
            Unavailable: The shared store cannot be reached.
        """
        settings = self.settings
        ttl_ms = int(max(link.tree.seconds_left(settings), 0) * 1000) + 60_000
        total = await self.store.count_tree_runs(link.root_run_id, 1, ttl_ms)
        if total is not None and total > settings.max_runs_per_tree:
            await self._give_back(link, counted_here=False)
            raise ResourceExhausted(
                f"the call tree has started {total - 1} runs on the replicas together; "
                f"max_runs_per_tree is {settings.max_runs_per_tree}", reason=RUN_TREE_FULL,
                retry_after=settings.limit_retry_after_seconds,
                metadata={"root_run_id": link.root_run_id,
                          "parent_run_id": link.parent_run_id})

    async def _give_back(self, link: TreeLink, *, counted_here: bool = True) -> None:
        """Gives back the place a run that did not start took in its tree (best effort in
        the shared store: a place lost there is one run fewer the tree may start)."""
        if counted_here:
            uncount(link)
        with contextlib.suppress(Exception):
            await self.store.count_tree_runs(link.root_run_id, -1, 60_000)

    async def _link_to(self, parent_run_id: str, principal: Principal) -> TreeLink:
        """The link under the run ``parent_run_id`` names (ExecuteRequest.parent_run_id):
        one of the caller's own (or any, for an admin) still going, here or on another
        replica.

        Raises:
            InvalidArgument: The id is over-long.
            NotFound: Unknown, expired, or not the caller's (a watcher of every run is no
                owner: a child would read and write the tree's state and spend its budget).
            FailedPrecondition: The parent has ended (``PARENT_RUN_ENDED``).
            Unavailable: The shared run store cannot be reached.
        """
        check_parent_id(parent_run_id)
        local = self.runs.get(parent_run_id)
        parent_log = local.log if local is not None else await self.store.open(parent_run_id)
        if parent_log is None or not self.run_access.may_hang_under(principal, parent_log.owner):
            raise NotFound("unknown parent run (or expired, or not yours)",
                           reason=_RUN_NOT_FOUND)
        if parent_log.finished or (local is not None and local.stop_requested):
            raise FailedPrecondition(
                "the parent run has ended; a run can only be hung under a run still going",
                reason=PARENT_RUN_ENDED, metadata={"parent_run_id": parent_log.run_id})
        if local is not None:
            return link_under(local)
        # The parent runs on another replica: what its log says of its tree is all it takes.
        root = parent_log.root_run_id or parent_log.run_id
        tree = self.trees.get(root)
        if tree is None:
            tree = self.trees[root] = CallTree(root)
        return TreeLink(parent_log.run_id, root, parent_log.depth + 1, tree)

    def _watch_remote_parent(self, child: Run, parent_run_id: str) -> None:
        """Ends ``child`` (CANCELLED, ``PARENT_RUN_ENDED``) once its parent, which runs on
        another replica, has ended: that replica cannot reach the child to stop it."""
        task = asyncio.create_task(self._follow_remote_parent(child, parent_run_id),
                                   name=f"run-{child.run_id}-parent")
        self._parent_watches.add(task)
        task.add_done_callback(self._parent_watches.discard)

        def stop_watching(_: Run) -> None:
            task.cancel()

        child.finish_hooks.append(stop_watching)

    async def _follow_remote_parent(self, child: Run, parent_run_id: str) -> None:
        # Looked at as often as the store looks for lost runs: a run's state in the shared
        # store says when it has ended, and no event of another replica's run reaches this
        # one unasked. Only runs an agent hung under another replica's run are watched.
        interval = self.settings.run_sweep_interval_seconds
        while not child.finished:
            await asyncio.sleep(interval)
            try:
                parent_log = await self.store.open(parent_run_id)
            except RequestError:  # the store is away: look again next time
                continue
            if parent_log is None or parent_log.finished:
                child.stop(Outcome.CANCELLED, PARENT_RUN_ENDED,
                           f"its parent run {parent_run_id} ended before it")
                return

    async def call_child(self, parent: Run, tool: str, arguments: Mapping[str, Any], *,
                         priority: int = 0, timeout: float | None = None,  # noqa: ASYNC109
                         calling_step_id: str = "") -> ChildResult:
        """Runs ``tool`` as a child of ``parent`` (``ctx.call``): admitted as any call is,
        for the parent's principal; its step events relayed into the parent's log under
        ``calling_step_id``; audited (refused or ended) through :attr:`audit_child`.

        Raises:
            ChildRunRefused: The child was refused before it started.
            ChildRunError: It ended other than OK.
        """
        asked_at = utc_now()
        # The child's own call record: the parent's run task holds the parent's in its
        # context, which the child's admission must not write into.
        # The tool as named (cut: a refusal's record keeps it even when there is no such tool).
        record = CallRecord(method=CHILD_METHOD, principal=parent.principal, tool=tool[:200])
        record.extra["invocation"] = parent.invocation
        left = max(parent.call_tree().seconds_left(self.settings), 0.001)
        policy = SupervisionPolicy.for_call(
            self.settings, left if timeout is None else min(timeout, left))
        request = RunRequest(tool_name=tool, arguments=dict(arguments),
                             invocation=parent.invocation, policy=policy, priority=priority,
                             parent=parent)
        token = current_call.set(record)
        try:
            admission = await self.admit(request, parent.principal)
        except RequestError as error:
            record.outcome = outcome_for_status(error.code)
            record.detail = f"{error.reason}: {error.message}"
            if self.audit_child is not None:
                self.audit_child(record, None, asked_at)
            raise ChildRunRefused(tool, error) from None
        finally:
            current_call.reset(token)
        child = admission.run
        assert child is not None  # a child has no idempotency key: it always starts
        relay = Relay(parent, child.run_id, calling_step_id or parent.root_step.id)
        child.observers.append(relay)
        parent.child_runs += 1
        auditor = self.audit_child
        if auditor is not None:
            child.finish_hooks.append(lambda ended: auditor(record, ended.result, asked_at))
        try:
            result = await child.wait()
        except asyncio.CancelledError:  # the parent's tool was cancelled: so is the child
            child.stop(Outcome.CANCELLED, PARENT_RUN_CANCELLED,
                       "a run above it in its call tree was cancelled")
            raise
        answer = child_result(child.run_id, child.spec.name, result, relay.chunks)
        if not answer.ok:
            raise ChildRunError.of(answer)
        return answer

    def _lane_ticket(self, run: Run, request: RunRequest, link: TreeLink | None
                     ) -> LaneTicket | None:
        """What the run asks of its lane; None for a lane without a limit (no wait), and
        for a child of a run of this process that holds a slot of the same lane — called by
        its tool (``ctx.call``), or named by ``parent_run_id`` once past its own gates, by the
        parent's own principal (a watcher of another's run gets no slot from it): it
        runs within the slot its parent holds while it waits for it (queued behind its own
        parent, a lane full of parents waiting for their children would never move). A
        parent on another replica is not known to hold a slot here: its child queues."""
        if run.lane not in self.lane_policy.limited:
            return None
        if request.parent is not None and request.parent.lane == run.lane:
            return None
        parent = link.parent if link is not None else None
        if (isinstance(parent, Run) and parent.lane == run.lane and parent.past_gates
                and not parent.finished and parent.principal.id == run.principal.id):
            return None
        return LaneTicket(run.run_id, run.lane, run.principal.id, run.priority,
                          request.max_wait_seconds)

    async def _enter_lane(self, ticket: LaneTicket) -> LanePlace:
        """The run's slot or place in its lane's queue.

        Raises:
            ResourceExhausted: LANE_FULL or LANE_BUSY (counted, with the lane).
        """
        try:
            return await self.lanes.enter(ticket)
        except ResourceExhausted as refused:
            metrics.LANE_REFUSALS.labels(ticket.lane, refused.reason.lower()).inc()
            raise

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

    async def drain(self, grace: float) -> None:
        """Refuses new runs, waits up to ``grace`` seconds for runs in flight, then cancels
        what is left (each still ends with its Result)."""
        self.draining = True
        runs = list(self.runs.values())
        if not runs:
            return
        log.info("draining", runs=len(runs), grace_seconds=grace)
        # Waits for the runs' Results, not their tasks: a tool that ignored its cancellation
        # keeps its run's task after the run has ended without it (Run._abandon_tool).
        waits = [asyncio.ensure_future(run.wait()) for run in runs]
        try:
            _, pending = await asyncio.wait(waits, timeout=grace)
            for run in list(self.runs.values()):
                run.stop(Outcome.CANCELLED, "SERVER_SHUTDOWN", "the server is shutting down")
            if pending:
                await asyncio.wait(pending, timeout=5)
        finally:
            for wait in waits:
                wait.cancel()
